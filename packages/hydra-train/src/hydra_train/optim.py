"""Optimizer (fused AdamW, or bitsandbytes AdamW8bit) and learning-rate schedules.

Weight decay applies to matrices (parameters with two or more dimensions, embeddings included) and
not to norms' gains, biases or other vectors.

Schedules (:class:`LRSchedule`, factor times the base learning rate of every group):

``cosine``  linear warmup from 1/warmup to 1 over ``warmup_steps``, then a cosine from 1 down to
            ``min_lr_ratio`` at ``max_steps``.
``wsd``     warmup-stable-decay: the same warmup, 1 until the last ``wsd_decay_frac`` of the steps,
            then a linear decay to ``min_lr_ratio`` at ``max_steps``.

The schedule follows the optimizer-step counter, skipped (non-finite) steps included, so a skip
does not shift the rest of the run. It writes ``group["lr"]`` in place when that is a tensor (a
CUDA-graph-captured optimizer reads its lr from device memory) and assigns a float otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hydra_kernels.ops.adamw import adamw_kernel_step_
from hydra_kernels.ops.adamw import kernel_takes as adamw_kernel_takes
from hydra_kernels.ops.adamw import launchable as adamw_launchable
from hydra_kernels.ops.total_norm import total_norm

if TYPE_CHECKING:
    from hydra_train.config import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """Fused AdamW runs on CUDA and (torch >= 2.4) CPU floating-point tensors."""
    return all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params)


@dataclass
class OptimizerChoice:
    optimizer: torch.optim.Optimizer
    name: str  # "adamw_fused", "adamw", "adamw8bit"
    note: str | None = None  # why the requested optimizer was not used


def _probe_8bit(bnb, device: torch.device) -> None:
    """One step of AdamW8bit on a throwaway parameter: catches builds that import but cannot run."""
    p = torch.nn.Parameter(torch.randn(4096, device=device))
    opt = bnb.optim.AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eight_bit: bool = False,
    log: Callable[[str], None] = print,
) -> OptimizerChoice:
    groups = param_groups(model, weight_decay)
    params = [p for g in groups for p in g["params"]]
    note = None
    if eight_bit:
        device = params[0].device if params else torch.device("cpu")
        try:
            import bitsandbytes as bnb

            if device.type != "cuda":
                raise RuntimeError(f"its 8-bit optimizers need CUDA parameters, these are on {device.type}")
            _probe_8bit(bnb, device)
            return OptimizerChoice(bnb.optim.AdamW8bit(groups, lr=lr, betas=betas), "adamw8bit")
        except Exception as exc:  # ImportError or a build that cannot run here
            reason = (
                "bitsandbytes is not installed (pip install 'hydra-train[8bit]')"
                if isinstance(exc, ImportError)
                else f"bitsandbytes is unusable here: {type(exc).__name__}: {exc}"
            )
            note = f"--8bit_adam: {reason}; using fused AdamW instead"
            log(note)
    fused = fused_adamw_supported(params)
    kw: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **kw)
    return OptimizerChoice(opt, "adamw_fused" if fused else "adamw", note)


def folds_grad_clip(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` can clip the gradients itself: a fused torch Adam/AdamW divides each gradient
    by its ``grad_scale`` as it reads it and writes the quotient back, so the clip needs no pass
    over the gradients of its own (``clip_grad_norm_`` reads and writes every gradient once more
    between the norm and the optimizer)."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and bool(opt.defaults.get("fused"))


def clip_divisor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_grad_norm_(max_norm)`` multiplies the gradients by, ``min(1, max_norm / (norm +
    1e-6))``, as the divisor a fused Adam takes: ``max(1, (norm + 1e-6) / max_norm)`` (fp32, on the
    norm's device; inf or NaN with a non-finite norm, where the step is skipped anyway)."""
    return torch.clamp((total_norm.float() + 1e-6) / max_norm, min=1.0)


def step_with(
    opt: torch.optim.Optimizer,
    grad_divisor: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``opt.step()`` with a fused Adam's ``grad_scale`` (each gradient divided by it, the result
    written back: :func:`clip_divisor`) and ``found_inf`` (1: the update skipped on the device,
    gradients untouched), cleared again afterwards so that a later step does not reuse them.
    Where :func:`kernel_step_groups` gives the groups, hydra_kernels' AdamW kernel steps them
    instead: the same update, the gradients not written back."""
    if (grad_divisor is not None or found_inf is not None) and not folds_grad_clip(opt):
        name = f"{type(opt).__name__} (fused={opt.defaults.get('fused')})"
        raise TypeError(f"{name} takes no grad_scale/found_inf: pass None, or build a fused Adam/AdamW")
    groups = kernel_step_groups(opt)
    if groups is not None:
        for group, lists in groups:
            adamw_kernel_step_(*lists, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                        eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=grad_divisor,
                        found_inf=found_inf)  # fmt: skip
        if getattr(opt.step, "_wrapped_by_lr_sched", False):
            # what torch's lr_scheduler records when opt.step() runs: without it, a scheduler
            # whose first step follows a kernel step (a resumed run's) warns it came first
            opt._opt_called = True
        return
    opt.grad_scale, opt.found_inf = grad_divisor, found_inf
    try:
        opt.step()
    finally:
        opt.grad_scale = opt.found_inf = None


def kernel_step_groups(opt: torch.optim.Optimizer) -> list[tuple[dict, tuple[list, ...]]] | None:
    """Each param group with its (parameters, gradients, moments, step counts) when hydra_kernels'
    AdamW kernel is to step ``opt`` (``adamw_step_``: the same update as torch's fused AdamW, the
    gradients left as they are), else None (then torch's own step runs): a fused torch AdamW
    without amsgrad, maximize, step hooks or an ``opt.step`` of its own (:func:`_own_step`), whose
    state is built (its first step is torch's), on plain contiguous fp32 tensors where
    hydra_kernels' Triton path is on, and not inside a CUDA graph capture that would need a launch
    plan built."""
    import torch.optim.optimizer as torch_optimizer

    if type(opt) is not torch.optim.AdamW or not opt.defaults.get("fused") or not _own_step(opt):
        return None
    # step hooks (the optimizer's, or every optimizer's) run only in torch's step: take it then
    if any(getattr(opt, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")):
        return None
    if any(
        getattr(torch_optimizer, name, None)
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    ):
        return None
    out = []
    for group in opt.param_groups:
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
            return None
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [opt.state.get(p) for p in params]
        if any(not st or "exp_avg" not in st for st in states):
            return None
        lists = (params, [p.grad for p in params], [st["exp_avg"] for st in states],
                 [st["exp_avg_sq"] for st in states], [st["step"] for st in states])  # fmt: skip
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device != params[0].device:
            return None
        if not adamw_kernel_takes(*lists):
            return None
        out.append((group, lists))
    # inside a CUDA graph capture a missing launch plan cannot be built (a host-to-device copy of
    # its table): a capture whose warm-up step was the optimizer's first (torch's, as the state
    # did not exist) finds none. Then torch's fused step (capturable, the same update) is captured
    # for every group, decided before any launch; a capture after a kernel step captures the kernel
    if not all(adamw_launchable(lists[0]) for _, lists in out):
        return None
    return out or None  # no gradients anywhere: torch's step (and its bookkeeping) as before


def _own_step(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` is its class's own, bare or wrapped by torch's lr_scheduler (which only
    records that it ran; step_with records it too). Any other instance override (an EMA, logging
    or accelerate wrapper) must run: step_with takes ``opt.step()`` then."""
    step, own = opt.step, type(opt).step
    if getattr(step, "_wrapped_by_lr_sched", False):  # the scheduler's wrapper: what it wraps
        return getattr(step, "__wrapped__", None) is own
    return getattr(step, "__func__", None) is own and getattr(step, "__self__", None) is opt


def grad_norm_for_step(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float, foreach: bool | None = None
) -> tuple[torch.Tensor, bool]:
    """(the gradients' total norm before clipping, whether ``opt`` is to clip them as it steps):
    with ``max_norm`` > 0 they are clipped here by ``clip_grad_norm_`` unless ``opt`` folds the
    clip (:func:`folds_grad_clip`; then step it with ``step_with(opt, clip_divisor(norm,
    max_norm))``). ``foreach``: ``clip_grad_norm_``'s; a norm without that clip is hydra_kernels'
    ``total_norm`` (torch's ``get_total_norm`` where its kernel does not take the gradients)."""
    folded = max_norm > 0 and folds_grad_clip(opt)
    if max_norm > 0 and not folded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach), False
    grads = [p.grad for p in params if p.grad is not None]
    # hydra_kernels' few-launch norm where it takes the gradients (plain CUDA tensors), else torch's
    return total_norm(grads), folded


def clip_and_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_(params, max_norm)`` (nothing when ``max_norm`` <= 0), then ``opt.step()``;
    the clip folded into the step where the optimizer can take it (:func:`folds_grad_clip`)."""
    divisor = None
    if max_norm > 0:
        norm, folded = grad_norm_for_step(opt, params, max_norm)
        divisor = clip_divisor(norm, max_norm) if folded else None
    step_with(opt, divisor)  # without a divisor: opt.step(), or hydra_kernels' AdamW for a fused one


class LRSchedule:
    """Sets every group's lr to ``base_lr * factor(step)``; ``state_dict`` is just the step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        kind: str,
        max_steps: int,
        warmup_steps: int,
        min_lr_ratio: float = 0.1,
        decay_frac: float = 0.2,
        step: int = 0,
    ):
        if kind not in ("cosine", "wsd"):
            raise ValueError(f"unknown schedule {kind!r}")
        self.kind, self.max_steps, self.warmup = kind, int(max_steps), int(warmup_steps)
        self.min_ratio, self.decay_frac = float(min_lr_ratio), float(decay_frac)
        self.step_count = int(step)
        self.attach(optimizer)

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LRSchedule:
        """The schedule a resolved TrainConfig asks for (--lr_schedule, --warmup_steps, ...), at step 0."""
        return cls(
            optimizer,
            kind=cfg.optim.lr_schedule,
            max_steps=cfg.runtime.max_steps,
            warmup_steps=cfg.optim.warmup_steps,
            min_lr_ratio=cfg.optim.min_lr_ratio,
            decay_frac=cfg.optim.wsd_decay_frac,
        )

    def fork(self) -> LRSchedule:
        """An independent schedule with the same settings and position, driving the same optimizer."""
        return LRSchedule(
            self.optimizer,
            kind=self.kind,
            max_steps=self.max_steps,
            warmup_steps=self.warmup,
            min_lr_ratio=self.min_ratio,
            decay_frac=self.decay_frac,
            step=self.step_count,
        )

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Drive ``optimizer`` (a replacement optimizer keeps the schedule's position)."""
        self.optimizer = optimizer
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", float(g["lr"]))
        self._apply()

    def factor(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.max_steps - self.warmup)
        if self.kind == "cosine":
            t = min(1.0, (step - self.warmup) / span)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        decay_start = self.max_steps - max(1, round(self.decay_frac * self.max_steps))
        if step < decay_start:
            return 1.0
        t = min(1.0, (step - decay_start) / max(1, self.max_steps - decay_start))
        return 1.0 - (1 - self.min_ratio) * t

    def phase(self, step: int | None = None) -> str:
        step = self.step_count if step is None else step
        if self.warmup and step < self.warmup:
            return "warmup"
        if self.kind == "cosine":
            return "cosine"
        decay_start = self.max_steps - max(1, round(self.decay_frac * self.max_steps))
        return "stable" if step < decay_start else "decay"

    def _apply(self) -> None:
        f = self.factor(self.step_count)
        self._last_lr = []
        for g in self.optimizer.param_groups:
            lr = float(g["initial_lr"]) * f
            self._last_lr.append(lr)  # kept as floats: reading a tensor lr back would sync
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def base_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["initial_lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "kind": self.kind,
            "max_steps": self.max_steps,
            "warmup": self.warmup,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self._apply()
