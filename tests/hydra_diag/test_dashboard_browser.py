"""The dashboard page in headless Chromium (over the DevTools protocol): every chart drawn with the
points the database holds, and the page following a `hydra-train run` while it writes.

Without a Chromium these tests say so loudly and skip; CI installs Debian's package and sets
HYDRA_REQUIRE_CHROMIUM=1 (.ci/run), which turns a missing browser into a failure.
Set ``HYDRA_DASHBOARD_SCREENSHOT=path.png`` to keep the live run's screenshot (docs/dashboard.png
is made that way).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from .chromium_cdp import find_chromium, headless_chromium
from .conftest import VOCAB, assert_png, synthetic_db
from .dashboard_helpers import db_rows, serving

pytest.importorskip("websocket", reason="the DevTools client needs websocket-client (hatch env test has it)")
if find_chromium() is None and os.environ.get("HYDRA_REQUIRE_CHROMIUM"):
    # .ci/run sets it: CI must run these tests, not skip them
    pytest.fail(
        "no Chromium found and HYDRA_REQUIRE_CHROMIUM is set (apt-get install chromium)", pytrace=False
    )
if find_chromium() is None:
    warnings.warn(
        "NO CHROMIUM ON THIS MACHINE: the dashboard browser tests are SKIPPED "
        "(apt-get install chromium, or set HYDRA_CHROMIUM); CI must have one",
        stacklevel=1,
    )
    pytest.skip(
        "no Chromium found: apt-get install chromium (or set HYDRA_CHROMIUM)", allow_module_level=True
    )

#: per chart: each trace's name, the non-null points it holds, and whether plotly drew it
CHARTS_JS = """(() => {
  const out = {};
  for (const el of document.querySelectorAll('.chart')) {
    const count = (a) => (a || []).filter((v) => v !== null && v !== undefined).length;
    out[el.id] = {
      traces: (el.data || []).map((t) => ({
        name: t.name, type: t.type,
        n: t.z ? t.z.reduce((a, row) => a + count(row), 0) : count(t.y),
      })),
      lines: el.querySelectorAll('.scatterlayer .js-line').length,
      heatmaps: el.querySelectorAll('.hm image').length,
    };
  }
  return out;
})()"""


def _n(chart: dict, name: str) -> int:
    return next(t["n"] for t in chart["traces"] if t["name"] == name)


def test_page_draws_every_chart_from_the_run(tiny_run, tmp_path):
    db = tiny_run.folder / "training.db"
    rid = tiny_run.summary["run_id"]
    count = {
        t: db_rows(db, f"SELECT count(*) AS n FROM {t} WHERE run_id=?", (rid,))[0]["n"]
        for t in ("steps", "evals", "adaptive_lr", "routing_mod", "routing_mor", "routing_moe")
    }
    layers = {
        t: [
            r["layer"]
            for r in db_rows(db, f"SELECT DISTINCT layer FROM {t} WHERE run_id=? ORDER BY layer", (rid,))
        ]
        for t in ("routing_mor", "routing_moe")
    }
    with serving(tiny_run.folder) as url, headless_chromium(tmp_path / "profile") as page:
        page.navigate(url)
        page.wait_for("window.hydraDashboard && window.hydraDashboard.renders > 0")
        charts = page.evaluate(CHARTS_JS)
        shot = page.screenshot(tmp_path / "dashboard.png")
        runs_listed = page.evaluate("document.querySelectorAll('#runs li').length")
        safe_text = page.evaluate("document.getElementById('safe-opts').innerText")
    assert_png(shot)
    assert runs_listed == 1 and "requested: cuda_graphs" in safe_text
    loss = charts["chart-loss"]
    for name in ("loss", "EMA short (0.99)", "EMA medium (0.999)", "EMA long (0.9999)"):
        assert _n(loss, name) == count["steps"] == 8
    assert _n(loss, "validation") == count["evals"] >= 2
    assert _n(charts["chart-compare"], f"{rid} EMA short") == count["steps"]
    assert _n(charts["chart-lr"], "lr") == count["adaptive_lr"]
    for chart, name in (("chart-grad", "grad norm"), ("chart-tps", "tokens/s"), ("chart-mem", "memory MiB")):
        assert _n(charts[chart], name) == count["steps"], chart
    assert _n(charts["chart-mod"], "MoD") == count["routing_mod"] > 0 and charts["chart-mod"]["heatmaps"] == 1
    assert sum(t["n"] for t in charts["chart-mor"]["traces"]) == 2 * count["routing_mor"] > 0
    assert len(charts["chart-mor"]["traces"]) == 2 * len(layers["routing_mor"])
    assert sum(t["n"] for t in charts["chart-moe"]["traces"]) == 2 * count["routing_moe"] > 0
    assert len(charts["chart-moe"]["traces"]) == 2 * len(layers["routing_moe"])
    last_moe = db_rows(
        db,
        "SELECT utilization FROM routing_moe WHERE run_id=? AND step=(SELECT max(step) FROM routing_moe "
        "WHERE run_id=?)",
        (rid, rid),
    )
    shares = sum(len(json.loads(r["utilization"])) for r in last_moe)
    assert _n(charts["chart-moe-util"], "utilisation") == shares == 3 * 4  # 3 layers, 4 experts
    assert charts["chart-moe-util"]["heatmaps"] == 1
    for chart in ("chart-loss", "chart-compare", "chart-lr", "chart-grad", "chart-tps", "chart-mem"):
        assert charts[chart]["lines"] >= len(charts[chart]["traces"]), chart  # plotly drew each line


def _train_args(data: Path, ckpt: Path, steps: int, lr: str) -> list[str]:
    return [
        *("run", "--dataset", str(data), "--vocab-size", str(VOCAB), "--model_size", "tiny", "--moe"),
        *(
            "--model_override",
            "dim=64",
            "--model_override",
            "n_mor_blocks=3",
            "--model_override",
            "max_seq_len=64",
        ),
        *("--seq_len", "32", "--batch-size", "4", "--max_steps", str(steps), "--log_every", "2"),
        *("--eval_every", "20", "--eval_batches", "2", "--save_every", "0", "--checkpoint_dir", str(ckpt)),
        *("--device", "cpu", "--cpu_threads", "1", "--lr", lr, "--warmup_steps", "5"),
        # one optimization that CPU can pretest, so that SafeOptimizations has a status to show
        *("--experimental_prefetch_threads", "1", "--pretest_warmup_steps", "1", "--pretest_steps", "2"),
    ]


@pytest.mark.slow
def test_page_follows_a_live_training_run(tmp_path):
    """`hydra-train run` writes while the page is open: the steps it shows grow, trailing the
    database by a few seconds at most; an earlier run is ticked and overlaid; the live run is then
    interrupted (Ctrl-C) and shown so."""
    from hydra_diag.synthetic import write_bigram_dataset

    data = write_bigram_dataset(tmp_path / "data", VOCAB, 8000, 3000, seed=0)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [sys.executable, "-m", "hydra_train"]
    subprocess.run([*train, *_train_args(data, ckpt, 40, "1e-3")], env=env, check=True, capture_output=True)
    db = ckpt / "training.db"
    earlier = db_rows(db, "SELECT run_id FROM runs")[0]["run_id"]
    proc = subprocess.Popen(
        [*train, *_train_args(data, ckpt, 100_000, "3e-3")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    keep = os.environ.get("HYDRA_DASHBOARD_SCREENSHOT")
    try:
        end = time.monotonic() + 120
        while _last_step(db) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < end, "the training wrote no step in 120 s"
            time.sleep(0.2)
        # relative (the tests run in tmp_path): the page, and docs/dashboard.png, show "ckpt/training.db"
        with serving("ckpt") as url, headless_chromium(tmp_path / "profile") as page:
            page.navigate(url)
            shown = (
                "(() => { const d = window.hydraDashboard; const s = d && d.selected && d.data[d.selected]; "
                "return s && s.rows.steps.length ? s.rows.steps[s.rows.steps.length - 1].step : 0; })()"
            )
            first = page.wait_for(shown)
            assert page.evaluate("window.hydraDashboard.selected") != earlier  # the newest run first
            page.evaluate(  # tick the earlier run: its curves join the comparison
                "[...document.querySelectorAll('#runs li')].find((li) => li.innerText.includes("
                f"{earlier!r})).querySelector('input').click()"
            )
            compare = (
                f"{CHARTS_JS}['chart-compare'].traces.find((t) => t.name === {earlier + ' EMA short'!r})"
            )
            assert page.wait_for(compare)["n"] == 20  # 40 steps logged every 2
            target = max(first + 60, 160 if keep else 0)  # the docs screenshot wants a longer curve
            written: dict[int, float] = {}  # logged step -> when this test first saw it in the database
            delays: list[float] = []  # from then until the page showed it
            while True:
                written.setdefault(_last_step(db), time.monotonic())
                now = page.evaluate(shown)
                delays += [time.monotonic() - t for s, t in written.items() if s <= now]
                written = {s: t for s, t in written.items() if s > now}
                # several polls, not one that happened to catch several steps (a loaded machine)
                polls = page.evaluate("window.hydraDashboard.polls")
                if now >= target and len(delays) >= 3 and polls >= 3:
                    break
                assert time.monotonic() < end + 300, f"the page stopped at step {now} ({polls} polls)"
                time.sleep(0.25)
            # a step reaches the page within a poll (2 s) plus fetch and render: a few seconds
            assert max(delays) < 5.0, delays
            page.wait_for("document.getElementById('safe-opts').innerText.includes('prefetch_threads')")
            safe_text = page.evaluate("document.getElementById('safe-opts').innerText")
            shot = page.screenshot(tmp_path / "live.png")
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            page.wait_for("document.getElementById('runs').innerText.includes('interrupted')", timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "requested: cuda_graphs" in safe_text and "prefetch_threads" in safe_text
    assert_png(shot)
    if keep:
        shutil.copyfile(shot, keep)


def _last_step(db: Path) -> int:
    """The last logged step of the run in progress (0 before it logs one)."""
    if not db.is_file():
        return 0
    sql = "SELECT max(s.step) AS s FROM steps s JOIN runs r ON r.run_id=s.run_id WHERE r.status='running'"
    return db_rows(db, sql)[0]["s"] or 0


ROW = dict(loss=3.0, lr=1e-3, grad_norm=1.0, ema_short=3.0, ema_medium=3.0, ema_long=3.0)
#: the steps the page holds for a run
HELD = "(window.hydraDashboard.data[{rid!r}] || {{rows: {{steps: []}}}}).rows.steps.map((s) => s.step)"


def test_page_shows_a_run_ending_without_new_rows(tmp_path):
    """hydra-train commits the last logged step, then the run's status in a commit of its own
    (finish_run): the status card follows the runs list to 'finished' with no new row to read."""
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    synthetic_db(tmp_path, [dict(step=s, **ROW) for s in (1, 2, 3)], status="running")
    cards = "document.getElementById('cards').innerText"
    with serving(tmp_path) as url, headless_chromium(tmp_path / "profile") as page:
        page.navigate(url)
        page.wait_for(
            f"window.hydraDashboard && window.hydraDashboard.renders > 0 && {cards}.includes('running')"
        )
        with TrainingDB(tmp_path / DB_NAME) as db:
            db.finish_run("run1", "finished")
        page.wait_for("document.getElementById('runs').innerText.includes('finished')", timeout=15)
        polls = page.evaluate("window.hydraDashboard.polls")
        page.wait_for(f"window.hydraDashboard.polls >= {polls + 2}", timeout=15)
        assert "finished" in page.evaluate(cards)


def test_page_forgets_rows_a_resume_superseded(tmp_path):
    """The page holds a run's steps 1..10; the run dies and a resume from its step-5 checkpoint
    drops its steps 6..10 from the database (TrainingDB.start_run): the page drops them too."""
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    synthetic_db(tmp_path, [dict(step=s, **ROW) for s in range(1, 11)], status="running")
    with serving(tmp_path) as url, headless_chromium(tmp_path / "profile") as page:
        page.navigate(url)
        page.wait_for(f"{HELD.format(rid='run1')}.length === 10")
        page.evaluate("document.querySelector('#runs li').click()")  # pin run1: no following
        with TrainingDB(tmp_path / DB_NAME) as db:
            db.conn.execute("UPDATE runs SET status='killed' WHERE run_id='run1'")
            db.start_run("run2", "tiny", 5, {"max_steps": 100}, resumed_from="run1")
            for s in (6, 7):
                db.log_step("run2", s, **ROW)
            db.commit()
        assert (
            db_rows(tmp_path / DB_NAME, "SELECT max(step) AS s FROM steps WHERE run_id='run1'")[0]["s"] == 5
        )
        page.wait_for("document.getElementById('runs').innerText.includes('run2')", timeout=15)
        polls = page.evaluate("window.hydraDashboard.polls")
        page.wait_for(f"window.hydraDashboard.polls >= {polls + 2}", timeout=15)
        assert page.evaluate("window.hydraDashboard.selected") == "run1"
        assert page.evaluate(HELD.format(rid="run1")) == [1, 2, 3, 4, 5]
        assert _n(page.evaluate(CHARTS_JS)["chart-loss"], "loss") == 5
