"""Where a single ``generate`` call's time goes when it builds its decoder: the GPT and HYDRA (100M
presets, bf16, random weights, 64-token prompt, 128 new tokens, batch BATCH), after warm-up calls
that compiled every kernel. Each of REPEATS calls drops the kept decoder first, so it prefills
eagerly, warms up and captures its step; the host time of each phase is summed over the call:
the prefill forward, the warm-up step (every stage once, eagerly), the capture of the step's
pieces, the driver's composition of them (graph_compose.py), the fingerprint's launch and the
final reads. Phases are host time (no sync added: the host bounds these phases at batch 1); the
call's own time ends with its result on the host. Medians over REPEATS. Writes
$OUT/first_call_phases.json.

    source tools/gpu_env.sh
    BATCH=1 python packages/hydra-diag/bench/first_call_phases.py
"""

import collections
import json
import os
import statistics
import time

import torch

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model, decode_graphs, decoder_hold

PROMPT, NEW = 64, 128
REPEATS = int(os.environ.get("REPEATS", "7"))
BATCH = int(os.environ.get("BATCH", "1"))

#: (owner, attribute, phase): the functions whose host time is a phase (those a tree lacks are
#: skipped, so that an older tree can be timed alike)
PHASES = [
    (decode_graphs.StagedDecoder, "_capture_step", "capture (pieces + compose)"),
    (decode_graphs, "ComposedGraph", "compose + instantiate"),
    (decode_graphs.StagedDecoder, "_warm_up_and_capture", "warm-up step + capture"),
    (decoder_hold, "start_keep", "fingerprint launch"),
    (getattr(decoder_hold, "PendingKeep", None), "finish", "fingerprint read"),
    (decoder_hold, "keep", "keep (fingerprint, older tree)"),
    (decode_graphs.StagedDecoder, "finish", "decisions read (last sync)"),
]


class PhaseClock:
    """Sums the host time of the PHASES functions while active (a wrapper each)."""

    def __init__(self) -> None:
        self.ms: collections.Counter[str] = collections.Counter()
        self._saved = []

    def __enter__(self):
        for owner, attr, phase in PHASES:
            real = getattr(owner, attr, None)
            if real is None:
                continue
            self._saved.append((owner, attr, real))

            def timed(*args, _real=real, _phase=phase, **kwargs):
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.ms[_phase] += 1000.0 * (time.perf_counter() - start)

            setattr(owner, attr, timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)


def prefill_clock(model, clock: PhaseClock):
    """Times the model's forward with a fresh cache (the prefill) as a phase."""
    real = type(model).forward

    def forward(self, input_ids, targets=None, *, cache=None):
        if cache is None or cache.seq_len:
            return real(self, input_ids, targets, cache=cache)
        start = time.perf_counter()
        try:
            return real(self, input_ids, targets, cache=cache)
        finally:
            clock.ms["prefill forward"] += 1000.0 * (time.perf_counter() - start)

    return real, forward


def first_calls(model, prompt) -> dict:
    with torch.no_grad():
        for _ in range(2):  # kernels compiled, autotuned, probes run
            model.generate(prompt, NEW)
    rows = []
    for _ in range(REPEATS):
        model.release_decoder()
        torch.cuda.synchronize()
        clock = PhaseClock()
        real, forward = prefill_clock(model, clock)
        type(model).forward = forward
        try:
            with clock, torch.no_grad():
                start = time.perf_counter()
                model.generate(prompt, NEW)
                torch.cuda.synchronize()
                total = 1000.0 * (time.perf_counter() - start)
        finally:
            type(model).forward = real
        report = model.last_decode_report
        assert not report.reused and report.capture == "one graph", report
        rows.append({"call_ms": total, **clock.ms})
    keys = rows[0].keys()
    out = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    out["capture_ms (report)"] = report.capture_ms
    out["tokens_per_s"] = BATCH * NEW / (out["call_ms"] / 1000.0)
    return out


def main() -> None:
    dev, rows = torch.device("cuda"), {}
    for cfg in resolve_configs(parse_config_names("gpt,hydra"), [], lr=1.0, compile_default="none"):
        torch.manual_seed(0)
        model = build_model(cfg.arch, "100M", **cfg.overrides).to(dev).eval().to(torch.bfloat16)
        prompt = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), device=dev)
        rows[cfg.name] = first_calls(model, prompt)
        print(cfg.name, {k: round(v, 2) for k, v in rows[cfg.name].items()}, flush=True)
        del model
    ratio = rows["hydra"]["tokens_per_s"] / rows["gpt"]["tokens_per_s"]
    print(f"single call, batch {BATCH}: hydra / gpt = {ratio:.3f}")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"first_call_phases_b{BATCH}.json"), "w") as f:
        summary = {"device": torch.cuda.get_device_name(), "batch": BATCH, "rows": rows, "ratio": ratio}
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
