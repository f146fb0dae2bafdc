"""hydra_diag.dashboard: the JSON endpoints against what training.db holds (a real CPU run), the
static files, incremental reads, and new rows appearing while a writer commits."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from .conftest import synthetic_db
from .dashboard_helpers import db_rows, get, get_json, serving


@pytest.fixture(scope="module")
def served(tiny_run):
    with serving(tiny_run.folder) as url:
        yield url, tiny_run.folder / "training.db"


def test_runs_endpoint_is_the_runs_table(served):
    url, db = served
    got = get_json(url + "api/runs")
    want = db_rows(
        db,
        "SELECT r.run_id, r.status, r.end_step, max(s.step) AS last, count(s.step) AS n FROM runs r "
        "JOIN steps s ON s.run_id=r.run_id GROUP BY r.run_id ORDER BY r.started_at",
    )
    assert got["database"] == str(db.resolve()) or Path(got["database"]).samefile(db)
    assert [
        (r["run_id"], r["status"], r["end_step"], r["last_step"], r["logged_steps"]) for r in got["runs"]
    ] == [(w["run_id"], w["status"], w["end_step"], w["last"], w["n"]) for w in want]


def test_run_endpoint_holds_every_row(served, tiny_run):
    url, db = served
    rid = tiny_run.summary["run_id"]
    got = get_json(f"{url}api/run/{rid}")
    assert got["run"]["run_id"] == rid and got["run"]["status"] == "finished"
    assert got["config"]["max_steps"] == 16
    steps = db_rows(db, "SELECT * FROM steps WHERE run_id=? ORDER BY step", (rid,))
    assert [s["step"] for s in got["steps"]] == [s["step"] for s in steps] == list(range(2, 17, 2))
    for g, s in zip(got["steps"], steps, strict=True):
        for key in (
            "loss",
            "ema_short",
            "ema_medium",
            "ema_long",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "memory_mb",
        ):
            assert g[key] == s[key], key
        assert g["skipped_steps"] == s["skipped_steps"]
    evals = db_rows(db, "SELECT step, val_loss, val_ppl FROM evals WHERE run_id=? ORDER BY step", (rid,))
    assert got["evals"] == evals and len(evals) >= 2
    mod = db_rows(
        db, "SELECT step, layer, selected_frac FROM routing_mod WHERE run_id=? ORDER BY step, layer", (rid,)
    )
    assert [(r["step"], r["layer"], r["selected_frac"]) for r in got["routing_mod"]] == [
        (r["step"], r["layer"], r["selected_frac"]) for r in mod
    ]
    assert mod and {r["layer"] for r in mod} == {1}
    mor = db_rows(
        db,
        "SELECT step, layer, avg_depth, expected_depth FROM routing_mor WHERE run_id=? ORDER BY step, layer",
        (rid,),
    )
    assert got["routing_mor"] == mor
    moe = db_rows(
        db,
        "SELECT step, layer, entropy, utilization FROM routing_moe WHERE run_id=? ORDER BY step, layer",
        (rid,),
    )
    assert [(m["step"], m["layer"], m["entropy"], m["utilization"]) for m in got["routing_moe"]] == [
        (m["step"], m["layer"], m["entropy"], json.loads(m["utilization"])) for m in moe
    ]
    assert got["adaptive_lr"] == db_rows(
        db, "SELECT step, lr, base_lr, factor, phase FROM adaptive_lr WHERE run_id=? ORDER BY step", (rid,)
    )
    # what the run's flags request (by hand from its config; on CPU they log no pretest: N/A)
    cfg = got["config"]
    flags = {
        "fp8": cfg["experimental_fp8"],
        "cuda_graphs": cfg["experimental_cuda_graphs"],
        "compile": cfg["compile"],
        "fa3": cfg["experimental_fa3"],
        "blackwell_tuning": cfg["experimental_blackwell_tuning"],
        "prefetch_threads": cfg["experimental_prefetch_threads"] > 0,
    }
    requested = got["safe_opts"]["requested"]
    assert {n for n, on in flags.items() if on} == set(requested) - {
        "8bit_adam",
        "triton_kernels",
        "static_routing",
    }
    assert {n for n, s in got["safe_opts"]["status"].items() if s["status"] == "REQUESTED"} == set(requested)
    assert got["safe_opts"]["anomalies"] == []


def test_incremental_reads_return_only_later_rows(served, tiny_run):
    url, _ = served
    rid = tiny_run.summary["run_id"]
    got = get_json(f"{url}api/run/{rid}?steps=10&evals=16&routing_mod=14&routing_moe=99")
    assert [s["step"] for s in got["steps"]] == [12, 14, 16]
    assert got["evals"] == [] and got["routing_moe"] == []
    assert {r["step"] for r in got["routing_mod"]} == {16}
    assert len(got["adaptive_lr"]) == 8  # no cursor given: every row


def test_static_files_and_unknown_paths(served):
    import plotly

    url, _ = served
    code, html, ctype = get(url)
    assert code == 200 and ctype.startswith("text/html")
    assert b'src="/static/plotly.min.js"' in html and b"/static/dashboard.js" in html and b"http" not in html
    code, js, _ = get(url + "static/plotly.min.js")
    assert (
        code == 200 and js == (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    )
    for name in ("dashboard.js", "dashboard.css"):
        assert get(url + "static/" + name)[0] == 200
    assert "no such page" in get_json(url + "static/other.js", 404)["error"]
    assert "no run 'nope'" in get_json(url + "api/run/nope", 404)["error"]
    assert "step number" in get_json(url + "api/run/x?steps=ten", 400)["error"]


def test_the_store_cannot_write(tiny_run):
    from hydra_diag.dashboard.store import connect_ro

    conn = connect_ro(tiny_run.folder / "training.db")
    try:
        with pytest.raises(sqlite3.OperationalError, match=r"readonly|read-only|query_only"):
            conn.execute("DELETE FROM steps")
    finally:
        conn.close()


def test_new_steps_appear_while_a_run_writes(tmp_path):
    """A writer (hydra-train's TrainingDB, as the trainer uses it) commits a step every 0.1 s while
    readers poll as hard as they can: every committed step is served within a second, and the
    writer is never refused (no 'database is locked')."""
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    row = dict(
        loss=3.0, lr=1e-3, grad_norm=1.0, tokens_per_s=100.0, ema_short=3.0, ema_medium=3.0, ema_long=3.0
    )
    synthetic_db(tmp_path, [dict(step=1, **row)], status="running")
    committed: dict[int, float] = {}
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with TrainingDB(tmp_path / DB_NAME) as db:
                for step in range(2, 22):
                    db.log_step("run1", step, **{**row, "loss": 3.0 - step / 100})
                    db.log_routing("run1", step, {"mod": [{"layer": 1, "selected_frac": step / 100}]})
                    db.commit()
                    committed[step] = time.monotonic()
                    time.sleep(0.1)
        except BaseException as exc:
            errors.append(exc)

    with serving(tmp_path) as url:
        seen: dict[int, float] = {}
        hammer_stop = threading.Event()

        def hammer() -> None:  # extra readers: three browsers reloading everything
            while not hammer_stop.is_set():
                get_json(url + "api/run/run1")

        hammers = [threading.Thread(target=hammer, daemon=True) for _ in range(3)]
        writer = threading.Thread(target=write)
        for t in [*hammers, writer]:
            t.start()
        cursor, mod_cursor, end = 1, -1, time.monotonic() + 20
        while len(seen) < 20 and time.monotonic() < end:
            got = get_json(f"{url}api/run/run1?steps={cursor}&routing_mod={mod_cursor}")
            for s in got["steps"]:
                seen[s["step"]] = time.monotonic()
                assert s["loss"] == pytest.approx(3.0 - s["step"] / 100)
            for m in got["routing_mod"]:
                assert m["selected_frac"] == pytest.approx(m["step"] / 100)
            cursor = max([cursor, *seen])
            mod_cursor = max([mod_cursor, *(m["step"] for m in got["routing_mod"])])
            time.sleep(0.05)
        writer.join(30)
        hammer_stop.set()
        for t in hammers:
            t.join(10)
    assert not errors, errors
    assert sorted(seen) == list(range(2, 22))
    delays = [seen[s] - committed[s] for s in seen]
    assert max(delays) < 1.0, delays
