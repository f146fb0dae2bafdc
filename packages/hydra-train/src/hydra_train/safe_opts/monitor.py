"""Anomaly detection during training, without a per-step host sync.

**Reading the values.** Each step's loss, gradient norm and finiteness flag are stacked on the
device and copied into a slot of a pinned host buffer with ``non_blocking=True``, followed by a
CUDA event (:class:`StepReadback`). At every later step the callback reads the entries whose event
has completed (``event.query()`` never waits); at each log interval, where the runtime syncs
anyway, it reads all of them. So an anomaly is seen as soon as the GPU has finished that step,
usually 1-3 steps after the host launched it and never later than the next log interval, and it
costs one small copy per step, no sync. Timeliness matters only for what the monitor decides:
a non-finite step is already skipped on the device by the runtime (fused AdamW ``found_inf``)
whether or not anyone has looked at it yet. On the CPU the values are read at once.

**Detectors** (both compare with a bias-corrected EMA of earlier normal values; an anomalous value
is not folded into its EMA, so one spike does not raise the bar for the next):

* loss spike: a finite loss > ``threshold`` × EMA of the loss (α = 0.98, ~50 steps of memory),
  checked once 10 finite losses have been seen;
* non-finite: ``finite`` false → ``nan_grad`` / ``inf_grad`` from the gradient norm (``nan_loss``
  when the norm is finite and the loss is not);
* throughput drop: at each log interval, the interval's tokens/s (the runtime's synced figure,
  evaluation and saving excluded) < ``threshold`` × EMA of earlier intervals (α = 0.9), checked
  once 2 intervals have been seen. Per-step host timings are not used: without syncs they measure
  the launch queue, not the GPU. Unlike the loss, a slow interval *is* folded into its EMA: a
  lasting change of speed (an optimization switched off for good) becomes the new normal within
  about ten intervals instead of being flagged forever, while a slowdown of 2.5x after a settled
  baseline is still flagged in four consecutive intervals (three disable its cause). The interval
  in which an optimization was switched is skipped (compilation, graph capture), and the baseline
  is kept, so an isolation trial can see whether a slowdown goes on without the suspect.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from hydra_train.safe_opts.attribution import Anomaly
from hydra_train.safe_opts.registry import INF_GRAD, LOSS_SPIKE, NAN_GRAD, NAN_LOSS, THROUGHPUT_DROP


class EmaDetector:
    """value above (``above=True``) or below ``threshold`` × bias-corrected EMA → anomaly."""

    def __init__(
        self, threshold: float, alpha: float, min_count: int, above: bool, fold_anomalies: bool = False
    ):
        self.threshold, self.alpha = float(threshold), float(alpha)
        self.min_count, self.above, self.fold_anomalies = min_count, above, fold_anomalies
        self.ema = 0.0
        self.count = 0

    @property
    def baseline(self) -> float | None:
        if self.count == 0:
            return None
        return self.ema / (1.0 - self.alpha**self.count)

    def check(self, value: float) -> float | None:
        """Feed ``value``; returns the baseline it broke, or None. A normal value joins the EMA; an
        anomalous one only when ``fold_anomalies``."""
        base = self.baseline
        bad = False
        if self.count >= self.min_count and base is not None:
            bad = value > self.threshold * base if self.above else value < self.threshold * base
        if not bad or self.fold_anomalies:
            self.ema = self.alpha * self.ema + (1.0 - self.alpha) * value
            self.count += 1
        return base if bad else None

    def reset(self) -> None:
        self.ema, self.count = 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "count": self.count}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.ema, self.count = float(s["ema"]), int(s["count"])


class Detectors:
    def __init__(self, loss_spike_threshold: float, throughput_drop_threshold: float):
        self.loss = EmaDetector(loss_spike_threshold, 0.98, 10, above=True)
        self.speed = EmaDetector(throughput_drop_threshold, 0.9, 2, above=False, fold_anomalies=True)
        self.skip_speed_interval = False

    def step_anomalies(self, step: int, loss: float, grad_norm: float, finite: bool) -> list[Anomaly]:
        if not finite:
            if math.isnan(grad_norm):
                return [Anomaly(step, NAN_GRAD, grad_norm)]
            if math.isinf(grad_norm):
                return [Anomaly(step, INF_GRAD, grad_norm)]
            return [Anomaly(step, NAN_LOSS, loss)]
        base = self.loss.check(loss)
        return [] if base is None else [Anomaly(step, LOSS_SPIKE, loss, base)]

    def interval_anomalies(self, step: int, tokens_per_s: float) -> list[Anomaly]:
        if self.skip_speed_interval or not math.isfinite(tokens_per_s):
            self.skip_speed_interval = False
            return []
        base = self.speed.check(tokens_per_s)
        return [] if base is None else [Anomaly(step, THROUGHPUT_DROP, tokens_per_s, base)]

    def switched(self) -> None:
        """An optimization was switched: the interval in progress is not judged (see above)."""
        self.skip_speed_interval = True

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss.state_dict(), "speed": self.speed.state_dict()}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.loss.load_state_dict(s["loss"])
        self.speed.load_state_dict(s["speed"])


class StepReadback:
    """(loss, grad norm, finite) of each step to the host: pinned slots + events on CUDA."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.cuda = device.type == "cuda"
        self.capacity = capacity
        self.host = torch.empty((capacity, 3), dtype=torch.float32, pin_memory=True) if self.cuda else None
        self.slot = 0
        self.pending: deque[tuple[int, tuple[str, ...], Any, Any]] = deque()
        self.done: list[tuple[int, tuple[str, ...], tuple[float, float, bool]]] = []

    def push(self, step: int, active: tuple[str, ...], loss, grad_norm, finite) -> None:
        vals = torch.stack([loss.detach().float(), grad_norm.detach().float(), finite.detach().float()])
        if not self.cuda:
            self.pending.append((step, active, vals.tolist(), None))
            return
        if len(self.pending) >= self.capacity:  # the GPU is a whole ring behind: read the oldest
            self.done.append(self._read(self.pending.popleft()))
        slot = self.slot
        self.slot = (slot + 1) % self.capacity
        self.host[slot].copy_(vals, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.pending.append((step, active, slot, ev))

    def _read(self, entry) -> tuple[int, tuple[str, ...], tuple[float, float, bool]]:
        step, active, slot, ev = entry
        if ev is None:
            vals = slot
        else:
            ev.synchronize()
            vals = self.host[slot].tolist()
        return step, active, (vals[0], vals[1], vals[2] > 0.5)

    def ready(self, block: bool = False) -> list[tuple[int, tuple[str, ...], tuple[float, float, bool]]]:
        """Entries the device has finished, in step order (all of them when ``block``)."""
        out, self.done = self.done, []
        while self.pending:
            ev = self.pending[0][3]
            if ev is not None and not (block or ev.query()):
                break
            out.append(self._read(self.pending.popleft()))
        return out
