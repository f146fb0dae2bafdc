"""hydra_diag.dashboard on the edges a user meets: a run killed and resumed in the same folder (its
rows and SafeOptimizations events superseded), odd query strings, a --port out of range."""

from __future__ import annotations

import json

from .conftest import invoke, synthetic_db
from .dashboard_helpers import get_json, serving

ROW = dict(loss=3.0, lr=1e-3, grad_norm=1.0, ema_short=3.0, ema_medium=3.0, ema_long=3.0)


def _killed_then_resumed(folder):
    """run1 logs steps 1..10 and dies (``killed``, no ``ended_at``, as hydra-train's
    settle_dead_runs leaves it); run2 resumes its step-5 checkpoint an hour later."""
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    synthetic_db(folder, [dict(step=s, **ROW) for s in range(1, 11)], status="running")
    with TrainingDB(folder / DB_NAME) as db:
        db.conn.execute(
            "UPDATE runs SET status='killed', started_at='2026-01-01T10:00:00.000' WHERE run_id='run1'"
        )
        db.start_run("run2", "tiny", 5, {"max_steps": 100}, resumed_from="run1")
        db.conn.execute("UPDATE runs SET started_at='2026-01-01T11:00:00.250' WHERE run_id='run2'")
        for s in (6, 7):
            db.log_step("run2", s, **ROW)
        db.commit()


def _event(time: str, step: int, event: str, **more) -> str:
    return json.dumps({"time": time, "step": step, "event": event, **more}) + "\n"


def test_a_killed_run_shows_only_its_own_safe_opts_events(tmp_path):
    """A killed run has no end time; the event log has no run id. The resumed run's pretests and
    anomalies (from its start on) are its own, not also the dead run's."""
    from hydra_diag.dashboard.safe_events import events_path

    _killed_then_resumed(tmp_path)
    log = events_path(tmp_path)
    log.parent.mkdir()
    log.write_text(
        _event("2026-01-01T10:00:01", 0, "pretest", name="compile", status="PASS")
        + _event("2026-01-01T10:30:00", 8, "anomaly", name="compile", kind="loss_spike", at_step=8)
        + _event("2026-01-01T11:00:00", 5, "pretest", name="compile", status="FAIL")
        + _event("2026-01-01T11:20:00", 7, "anomaly", name=None, kind="grad_spike", at_step=7)
    )
    with serving(tmp_path) as url:
        dead = get_json(url + "api/run/run1")["safe_opts"]
        live = get_json(url + "api/run/run2")["safe_opts"]
    assert [a["at_step"] for a in dead["anomalies"]] == [8]
    assert [e["time"] for e in dead["events"]] == ["2026-01-01T10:00:01", "2026-01-01T10:30:00"]
    assert dead["status"]["compile"]["status"] == "ENABLED"
    assert [a["at_step"] for a in live["anomalies"]] == [7]
    assert live["status"]["compile"]["status"] == "FAILED"


def test_the_run_endpoint_says_what_each_table_holds_after_a_resume(tmp_path):
    """``last``: each table's last step now, so that a page holding the rows a resume dropped
    (run1's steps 6..10) learns that they are gone."""
    _killed_then_resumed(tmp_path)
    with serving(tmp_path) as url:
        got = get_json(url + "api/run/run1?steps=10&adaptive_lr=10")
        assert got["steps"] == [] and got["adaptive_lr"] == []
        assert got["last"] == {
            "steps": 5,
            "evals": None,
            "adaptive_lr": 5,
            "routing_mod": None,
            "routing_mor": None,
            "routing_moe": None,
        }
        assert get_json(url + "api/run/run2")["last"]["steps"] == 7


def test_a_step_number_out_of_range_is_a_bad_request(tmp_path):
    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    with serving(tmp_path) as url:
        got = get_json(url + "api/run/run1?steps=99999999999999999999", 400)
        assert "step number" in got["error"]
        assert get_json(url + "api/run/run1?steps=1")["steps"] == []  # the server still answers


def test_port_out_of_range(runner, tmp_path):
    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    for port in ("70000", "-1"):  # a usage error (exit 2), before the database is even opened
        res = invoke(runner, ["dashboard", tmp_path / "not-there", "--port", port])
        assert res.exit_code == 2 and "--port" in res.stderr, res.output


def test_an_unexpected_error_is_a_500_naming_it_and_the_server_goes_on(tmp_path, monkeypatch):
    """An error the handler does not expect (a row the page cannot use, a bug) answered nothing:
    the connection dropped and the page only showed "not updating". Now a 500 that names it, and
    the next request is served."""
    import secrets

    from hydra_diag.dashboard.store import DashboardStore

    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    word = secrets.token_hex(4)

    def broken(self, run_id, since=None, max_rows=None):
        raise ValueError(f"bad utilization JSON {word}")

    monkeypatch.setattr(DashboardStore, "run", broken)
    with serving(tmp_path) as url:
        got = get_json(url + "api/run/run1", 500)
        assert "ValueError" in got["error"] and word in got["error"] and "/api/run/run1" in got["error"]
        assert [r["run_id"] for r in get_json(url + "api/runs")["runs"]] == ["run1"]


def _get_with_host(url: str, host: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Host": host}), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_loopback_server_refuses_a_host_that_is_not_this_machine(tmp_path):
    """DNS rebinding: a page from another site whose name resolves to 127.0.0.1 reaches the server
    with its own name in Host; the run's data must not be served to it. Names of this machine,
    with or without a port, are answered."""
    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    with serving(tmp_path) as url:
        port = url.rstrip("/").rsplit(":", 1)[1]
        for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.attacker.example:{port}"):
            code, body = _get_with_host(url + "api/runs", host)
            assert code == 403, (host, body)
            assert host in body["error"] and "127.0.0.1" in body["error"]
            assert "runs" not in body
        ours = (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "localhost")
        for host in ours:
            code, body = _get_with_host(url + "api/runs", host)
            assert code == 200, (host, body)
            assert [r["run_id"] for r in body["runs"]] == ["run1"]


def test_a_server_on_another_loopback_address_answers_its_own_url(tmp_path):
    """Debian names the machine 127.0.1.1: a dashboard bound there (or reached by any 127.x.y.z)
    is this machine's, and its own URL must be answered (it was refused with a 403 telling the
    user to open the URL they had opened)."""
    import random
    import threading

    from hydra_diag.dashboard.server import DashboardServer
    from hydra_diag.dashboard.store import DashboardStore

    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    addr = f"127.0.{random.randint(1, 254)}.{random.randint(1, 254)}"
    server = DashboardServer(DashboardStore(tmp_path), addr, 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        assert server.url.startswith(f"http://{addr}:")
        assert [r["run_id"] for r in get_json(server.url + "api/runs")["runs"]] == ["run1"]
        port = server.url.rstrip("/").rsplit(":", 1)[1]
        assert _get_with_host(server.url + "api/runs", f"127.0.0.1:{port}")[0] == 200
        assert _get_with_host(server.url + "api/runs", f"evil.example:{port}")[0] == 403
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_server_on_a_chosen_address_answers_any_host(tmp_path):
    """--host 0.0.0.0 (or any non-loopback address) is the user's choice to expose the run: the
    Host check is off there, so a machine reached by its name is answered."""
    from hydra_diag.dashboard.server import host_name, is_loopback

    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.0.1.1") and is_loopback("[::1]") and not is_loopback("127.0.0.1.example.org")
    assert host_name("[::1]:8050") == "[::1]" and host_name("Example.org:80") == "example.org"
    assert host_name("127.0.0.1") == "127.0.0.1"


def test_a_long_runs_first_load_is_thinned_and_polls_continue_from_its_last_step(tmp_path):
    """?max_rows=M (what the page sends): each thinned table holds at most about M rows, evenly
    spaced logged steps with all of a step's layers, always the last step; evaluations are all
    there. A poll from the returned cursors gets exactly the rows logged after it; no max_rows:
    every row, as before."""
    import itertools
    import random

    from hydra_train.metrics_db import DB_NAME, TrainingDB

    rng = random.Random()
    n_steps, every, layers = rng.randint(900, 1400), rng.choice([1, 3, 5]), rng.randint(2, 5)
    logged = list(range(every, n_steps * every + 1, every))
    synthetic_db(tmp_path, [dict(step=s, **ROW) for s in logged], status="running")
    with TrainingDB(tmp_path / DB_NAME) as db:
        for s in logged:
            db.log_routing(
                "run1", s, {"mod": [{"layer": i, "selected_frac": rng.random()} for i in range(layers)]}
            )
            if s % (10 * every) == 0:
                db.log_eval("run1", s, rng.uniform(1, 5))
        db.commit()
    max_rows = rng.randint(100, 300)
    with serving(tmp_path) as url:
        every_row = get_json(url + "api/run/run1")
        assert (
            len(every_row["steps"]) == len(logged) and len(every_row["routing_mod"]) == len(logged) * layers
        )
        got = get_json(url + f"api/run/run1?max_rows={max_rows}")
        for table, per_step in (("steps", 1), ("adaptive_lr", 1), ("routing_mod", layers)):
            rows = got[table]
            assert len(rows) <= max_rows + per_step, (table, len(rows))
            steps = sorted({r["step"] for r in rows})
            assert steps[-1] == logged[-1] and len(steps) >= max_rows // per_step // 2
            gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}
            assert len(gaps) == 1, gaps  # evenly spaced (the last step aside)
            by_step = {}
            for r in rows:
                by_step.setdefault(r["step"], []).append(r.get("layer", 0))
            assert all(sorted(v) == list(range(per_step)) for v in by_step.values())
        assert got["evals"] == every_row["evals"]  # never thinned
        # the rows kept are the database's own, unchanged
        full = {(r["step"], r["layer"]): r for r in every_row["routing_mod"]}
        assert all(full[(r["step"], r["layer"])] == r for r in got["routing_mod"])
        with TrainingDB(tmp_path / DB_NAME) as db:
            for s in (logged[-1] + every, logged[-1] + 2 * every):
                db.log_step("run1", s, **ROW)
            db.commit()
        more = get_json(url + f"api/run/run1?steps={logged[-1]}&max_rows={max_rows}")
        assert [r["step"] for r in more["steps"]] == [logged[-1] + every, logged[-1] + 2 * every]
        assert get_json(url + "api/run/run1?max_rows=0", 400)["error"].startswith("?max_rows=")
