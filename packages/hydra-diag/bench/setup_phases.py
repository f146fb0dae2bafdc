"""Where ``hydra-train run``'s setup goes: the wall time of each phase before step 1, from outside.

The named functions of hydra-train are wrapped with timers (the library is not changed), then the
CLI runs with the arguments given after ``--``. Each wrapped call's start and duration, in seconds
since this process started (the Python start-up before this script runs is not counted), are
printed as each ends and in a table when the run ends, and written to ``--out`` as JSON. CUDA work
a phase queues is counted where the host waits for it, as the user waits.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/setup_phases.py --out phases.json -- \
        --model_size 100M --max_steps 60 --checkpoint_dir /tmp/tr/phases
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time

T0 = time.perf_counter()

#: (module, attribute[.method]) of each timed phase, in the order a run reaches them
PHASES = (
    ("hydra_train.run", "load_run_data"),
    ("hydra_train.run", "build_model"),
    ("hydra_train.run", "wrap_model"),
    ("hydra_train.run", "build_optimizer_and_schedule"),
    ("hydra_train.run", "eval_batches"),
    ("hydra_train.run", "_keep_tokenizer_beside"),
    ("hydra_train.run", "TrainingDB"),
    ("hydra_train.run_start", "settle_dead_runs"),
    ("hydra_train.safe_opts.callback", "SafeOptimizations.apply"),
    ("hydra_train.safe_opts.pretest", "PretestRunner._snapshot"),
    ("hydra_train.safe_opts.pretest", "PretestRunner._reference"),
    ("hydra_train.safe_opts.pretest", "PretestRunner._timed_arm"),
    ("hydra_train.trainer", "Trainer.evaluate"),
    ("hydra_train.graphed_step", "GraphedStep._warm_up_and_capture"),
)


def _wrap(records: list[dict], label: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = {"phase": label, "start_s": start - T0, "s": time.perf_counter() - start}
            records.append(rec)
            # as it happens too: a run cut off by a time limit still leaves its phases in the log
            print(f"[phase] {label} at {rec['start_s']:.2f} s: {rec['s']:.3f} s", file=sys.stderr, flush=True)

    return timed


def install(records: list[dict]) -> None:
    for module, attr in PHASES:
        mod = importlib.import_module(module)
        owner, _, name = attr.rpartition(".")
        owner = getattr(mod, owner) if owner else mod
        setattr(owner, name, _wrap(records, attr, getattr(owner, name)))
    # each optimization's switching on, within SafeOptimizations.apply
    from hydra_train.config import TrainConfig
    from hydra_train.safe_opts.registry import build_registry

    for opt in build_registry(TrainConfig()).values():
        cls = type(opt)
        cls.activate = _wrap(records, f"activate {cls.name}", cls.activate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the phases")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, run_args = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    records: list[dict] = []
    _wrap(records, "import hydra_train.cli", lambda: importlib.import_module("hydra_train.cli"))()
    from hydra_train.cli import app

    install(records)
    rc = 0
    try:
        app(["run", *run_args], standalone_mode=False)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    print(f"\n{'phase':<44} {'start s':>8} {'s':>8}")
    for r in records:
        print(f"{r['phase']:<44} {r['start_s']:8.2f} {r['s']:8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": run_args, "rc": rc, "phases": records}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
