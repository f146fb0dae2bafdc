"""How auto times an attention candidate: on CUDA the time it keeps the GPU busy (calls queued
behind a spin kernel, :func:`_gpu_ms`), elsewhere the host clock (:func:`_time_calls`; only tests
time on the CPU).

Separate from ``attention_backend.py``, which decides what is timed and keeps the picks
(``_measure``), and re-exports ``_gpu_ms`` and ``_time_calls`` for
``packages/hydra-diag/bench/attention_pick_timing.py``.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings

import torch


def _time_candidate(report, name, impl, inputs, causal, scale, needs_grad: bool) -> None:
    """The candidate's median ms into ``report[name]`` (or its error there): on CUDA the time it
    keeps the GPU busy (:func:`_gpu_ms`), elsewhere the host clock (only tests time on the CPU)."""
    # a candidate that cannot run these shapes makes torch warn why, on every rank's stderr; the
    # reason goes into the report, so the probe keeps those warnings to itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if inputs[0].is_cuda:
            try:
                report[name], host_bound = _gpu_ms(impl, inputs, causal, scale, needs_grad)
            except Exception as exc:  # a candidate that cannot run these shapes is not chosen
                report[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                return
            if host_bound:  # its calls waited on the GPU: timed with the host's share in it
                report[f"{name} (host-bound)"] = "the GPU went idle between its calls"
            return
        _time_calls(report, name, impl, inputs, causal, scale, needs_grad, cuda=False)


def _call(impl, args, causal, scale, needs_grad: bool) -> None:
    with torch.enable_grad() if needs_grad else torch.no_grad():
        out = impl(*args, causal, None, scale)
        if needs_grad:
            for t in args:
                t.grad = None  # each call writes its gradients, as in a step (no accumulating add)
            out.backward(torch.ones_like(out))


@functools.cache
def _cycles_per_ms() -> float:
    """The GPU's spin rate (``torch.cuda._sleep`` cycles a millisecond), measured once per process."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / max(start.elapsed_time(end), 1e-3)


def _gpu_ms(impl, inputs, causal, scale, needs_grad: bool, calls: int = 5) -> tuple[float, bool]:
    """Median over three rounds of the GPU time per call (forward, and backward where gradients
    are needed) of ``calls`` calls queued behind a spin kernel that outlasts their launching, so
    the events time the kernels back to back, not the host. Why not the eager calls' own time: at
    these sizes that is mostly the host's, which moves with the host's load and is not what the
    compiled, graphed step that uses the pick pays. Timed eagerly on an H100, flash-attention 2
    came out fastest in 2 of 5 measurements at 8 x 256, where it keeps the GPU 1.4x longer than
    cuDNN's kernel, and the race's compiled steps once ran it at every length
    (packages/hydra-model/BENCHMARKS.md, 2026-11-26). Returns (ms, host_bound): host_bound where
    the spin ended before the calls were queued even at its longest (a call that waits on the GPU
    itself, a host far slower than its kernels), so the time holds the host's gaps."""
    args = [t.detach().requires_grad_(needs_grad) for t in inputs]
    with torch.cuda.device(args[0].device):  # the spin must hold the stream the calls run on
        for _ in range(2):  # kernel selection, plan building
            _call(impl, args, causal, scale, needs_grad)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _call(impl, args, causal, scale, needs_grad)
        host_ms = (time.perf_counter() - t0) * 1000  # launching one call (the GPU may still run it)
        torch.cuda.synchronize()
        rate = _cycles_per_ms()
        spin = int(rate * min(2.0 * calls * host_ms + 1.0, 500.0))
        longest = int(rate * 1000.0)  # a second: the cap of the doubling below
        times, doubled, host_bound = [], 0, False
        while len(times) < 3:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(spin)
            start.record()
            for _ in range(calls):
                _call(impl, args, causal, scale, needs_grad)
            end.record()
            # the spin still running once every call is queued: no gap waited on the host. Else
            # (a faster clock than when the spin rate was taken, a slower host) again with a spin
            # twice as long, four times at most (a call that waits on the GPU itself never gets
            # ahead: it is timed with its waits, and flagged)
            ahead = not start.query()
            end.synchronize()
            if ahead or doubled >= 4 or spin >= longest:
                times.append(start.elapsed_time(end) / calls)
                host_bound = host_bound or not ahead
            else:
                spin, doubled = min(2 * spin, longest), doubled + 1
    return statistics.median(times), host_bound


def _time_calls(report, name, impl, inputs, causal, scale, needs_grad: bool, cuda: bool) -> None:
    """Eagerly: median ms of 5 timed calls after 2 untimed ones (CUDA events on the GPU)."""
    try:
        times = []
        for it in range(7):
            args = [t.detach().requires_grad_(needs_grad) for t in inputs]
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            _call(impl, args, causal, scale, needs_grad)
            if cuda:
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                elapsed = (time.perf_counter() - t0) * 1000
            if it >= 2:  # the first calls include kernel selection and plan building
                times.append(elapsed)
        report[name] = statistics.median(times)
    except Exception as exc:  # a candidate that cannot run these shapes is simply not chosen
        report[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
