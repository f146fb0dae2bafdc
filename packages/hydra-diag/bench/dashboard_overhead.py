"""Does an open dashboard slow the trainer? Step time of a CPU `hydra-train run`, without and with
`hydra-diag dashboard` serving and browser-like clients polling it.

Each trial is one `hydra-train run` of the narrowed tiny preset on a bigram stream, logging (and
so committing to training.db) every step: the trainer's most database-bound setting. Trials
alternate off/on so that a drift of the shared machine hits both alike. "on" starts the real
dashboard command and ``--clients`` pollers that request what the page requests (``/api/runs``,
then the newest run's rows after their cursors) every ``--interval`` seconds: the page polls
every 2 s, so the default 4 clients at 0.5 s are sixteen open tabs. ``--browser`` opens the page
in a headless Chromium on the same machine instead (polling and drawing the charts, as a person
watching would; ``--clients 0`` leaves only it). The step time is read back
from the database (``steps.time`` of consecutive steps), first ``--skip`` steps left out.

    python packages/hydra-diag/bench/dashboard_overhead.py --pairs 3 --steps 300
    python packages/hydra-diag/bench/dashboard_overhead.py --pairs 3 --steps 300 --clients 0 --browser
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

TABLES = ("steps", "evals", "adaptive_lr", "routing_mod", "routing_mor", "routing_moe")


def train_cmd(data: Path, ckpt: Path, steps: int) -> list[str]:
    return [
        *(sys.executable, "-m", "hydra_train", "run", "--dataset", str(data), "--vocab-size", "320"),
        *(
            "--model_size",
            "tiny",
            "--moe",
            "--model_override",
            "dim=64",
            "--model_override",
            "n_mor_blocks=3",
        ),
        *("--seq_len", "32", "--batch-size", "4", "--max_steps", str(steps), "--log_every", "1"),
        *(
            "--eval_every",
            "100",
            "--eval_batches",
            "2",
            "--save_every",
            "0",
            "--checkpoint_dir",
            str(ckpt),
            "--device",
            "cpu",
        ),
        *("--cpu_threads", "1", "--experimental_prefetch_threads", "0"),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_like_the_page(base: str, interval: float, stop: threading.Event, counter: list[int]) -> None:
    cursors: dict[str, dict[str, int]] = {}
    while not stop.is_set():
        try:
            with urllib.request.urlopen(base + "api/runs", timeout=10) as r:
                runs = json.load(r)["runs"]
            rid = runs[-1]["run_id"]
            cur = cursors.setdefault(rid, dict.fromkeys(TABLES, -1))
            query = "&".join(f"{t}={cur[t]}" for t in TABLES)
            with urllib.request.urlopen(f"{base}api/run/{rid}?{query}", timeout=10) as r:
                got = json.load(r)
            for t in TABLES:
                if got[t]:
                    cur[t] = got[t][-1]["step"]
            counter[0] += 1
        except OSError:
            pass  # the server is starting or stopping
        stop.wait(interval)


def step_times(db: Path, skip: int) -> list[float]:
    conn = sqlite3.connect(db)
    try:
        rid = conn.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()[0]
        t = [r[0] for r in conn.execute("SELECT time FROM steps WHERE run_id=? ORDER BY step", (rid,))]
    finally:
        conn.close()
    return [b - a for a, b in zip(t[skip:], t[skip + 1 :], strict=False)]


def trial(data: Path, ckpt: Path, args, dashboard: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = browser = None
    stop, counter, pollers = threading.Event(), [0], []
    if dashboard:
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "hydra_diag", "dashboard", str(ckpt), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        server.stdout.readline()  # "dashboard of ... at URL": listening
        base = f"http://127.0.0.1:{port}/"
        if args.browser:
            browser = subprocess.Popen(
                [
                    *(
                        shutil.which("chromium") or "chromium",
                        "--headless=new",
                        "--no-sandbox",
                        "--disable-gpu",
                    ),
                    *("--remote-debugging-port=0", f"--user-data-dir={ckpt.parent / 'chromium'}", base),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for _ in range(args.clients):
            pollers.append(
                threading.Thread(target=poll_like_the_page, args=(base, args.interval, stop, counter))
            )
            pollers[-1].start()
    try:
        done = subprocess.run(train_cmd(data, ckpt, args.steps), env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"hydra-train run failed: {done.stderr[-2000:]}")
    finally:
        stop.set()
        for p in pollers:
            p.join()
        for proc in (browser, server):
            if proc is not None:
                proc.terminate()
                proc.wait()
    dt = step_times(ckpt / "training.db", args.skip)
    return {
        "dashboard": dashboard,
        "median_ms": 1e3 * statistics.median(dt),
        "mean_ms": 1e3 * statistics.fmean(dt),
        "p95_ms": 1e3 * statistics.quantiles(dt, n=20)[-1],
        "requests": counter[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3, help="off/on trial pairs")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per trial")
    ap.add_argument("--skip", type=int, default=20, help="first steps left out (warm-up)")
    ap.add_argument("--clients", type=int, default=4, help="polling clients while the dashboard is on")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between a client's polls")
    ap.add_argument("--browser", action="store_true", help="also open the page in headless Chromium")
    args = ap.parse_args()

    from hydra_diag.synthetic import write_bigram_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_bigram_dataset(root / "data", 320, 8000, 3000, seed=0)
        ckpt = root / "ckpt"
        subprocess.run(train_cmd(data, ckpt, 5), check=True, capture_output=True)  # the DB has a run
        rows = []
        for i in range(args.pairs):
            for on in (False, True) if i % 2 == 0 else (True, False):
                rows.append(trial(data, ckpt, args, on))
                r = rows[-1]
                print(
                    f"dashboard {'on ' if on else 'off'}  median {r['median_ms']:6.2f} ms  mean "
                    f"{r['mean_ms']:6.2f} ms  p95 {r['p95_ms']:6.2f} ms  requests {r['requests']}",
                    flush=True,
                )
    off = [r["median_ms"] for r in rows if not r["dashboard"]]
    on = [r["median_ms"] for r in rows if r["dashboard"]]
    cpu = platform.processor() or platform.machine()
    print(
        f"\n{os.cpu_count()} CPUs ({cpu}); {args.steps} steps/trial, log_every 1, "
        f"{args.clients} clients every {args.interval} s"
        + (", headless Chromium on the page" if args.browser else "")
    )
    print(
        f"median step time, median over trials: off {statistics.median(off):.2f} ms, on "
        f"{statistics.median(on):.2f} ms ({100 * (statistics.median(on) / statistics.median(off) - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
