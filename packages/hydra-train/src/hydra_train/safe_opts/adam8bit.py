"""``--8bit_adam``: bitsandbytes' AdamW8bit, switched to and from torch's fused AdamW with the
optimizer state carried over.

How the state is carried (both directions keep parameters, hyper-parameters, ``initial_lr`` and
the step count):

* torch -> 8-bit (activate): each first moment ``exp_avg`` and second moment ``exp_avg_sq`` is
  quantised blockwise the way bitsandbytes stores them: blocks of 256 values, each scaled by its
  absolute maximum, then rounded to the nearest entry of the optimizer's own code table (its
  signed dynamic map for the first moment, the unsigned one for the second). Parameters smaller
  than bitsandbytes' ``min_8bit_size`` keep 32-bit states, copied exactly. Error per element:
  at most half the gap between neighbouring codes, times the block's absmax.
* 8-bit -> torch (deactivate, and every checkpoint save): dequantised, ``code[q] · absmax``,
  exact; the rebuilt fused AdamW continues from those moments.

Checkpoints always hold torch-format state (the save is wrapped; see
:class:`hydra_train.safe_opts.callback.SafeOptimizations`), so a checkpoint loads whichever
optimizer the next run uses; resuming with 8-bit active re-quantises, which is why resume is
exact up to one quantisation step there (and bit-exact everywhere else). Checkpoints written
before the save was wrapped (``run`` built AdamW8bit itself) hold bitsandbytes' state; torch's
AdamW loads it without a word and fails at its first step (KeyError 'exp_avg'):
:func:`adamw_state_dict_from_8bit` converts such a state, bitsandbytes or not, on resume.

bitsandbytes' AdamW8bit has no ``found_inf`` input, so with it the trainer reads the finiteness
flag on the host before stepping (one sync per step, the runtime's documented rule), and CUDA
graphs cannot capture the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hydra_train.errors import HydraCheckpointError
from hydra_train.safe_opts.registry import Optimization

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer

BLOCK = 256  # bitsandbytes' block size for its blockwise 8-bit optimizer states
_TINY = 1e-30


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) → (q uint8 with x's numel, absmax fp32 [blocks]): q = nearest code to x/absmax."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    padded = padded.view(blocks, BLOCK)
    absmax = padded.abs().amax(dim=1)
    normed = padded / absmax.clamp_min(_TINY).unsqueeze(1)
    sorted_code, order = code.float().to(flat.device).sort()
    mids = (sorted_code[1:] + sorted_code[:-1]) / 2  # decision boundaries between neighbours
    pos = torch.bucketize(normed.reshape(-1), mids)
    q = order[pos].to(torch.uint8)[:n]
    return q, absmax


def dequantize_blockwise(q: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """code[q] · absmax of q's block, as fp32 with q's shape."""
    flat = q.reshape(-1).long()
    scale = absmax.float().repeat_interleave(BLOCK)[: flat.numel()]
    return (code.float().to(q.device)[flat] * scale).view(q.shape)


def _group_hparams(g: dict[str, Any]) -> dict[str, Any]:
    lr = g["lr"]
    out = {
        "lr": float(lr),
        "betas": tuple(g["betas"]),
        "eps": g["eps"],
        "weight_decay": g["weight_decay"],
    }
    if "initial_lr" in g:
        out["initial_lr"] = g["initial_lr"]
    return out


def to_8bit(opt: torch.optim.Optimizer, bnb_module: Any) -> torch.optim.Optimizer:
    """A bitsandbytes AdamW8bit over ``opt``'s parameters with ``opt``'s moments quantised in."""
    groups = [{"params": list(g["params"]), **_group_hparams(g)} for g in opt.param_groups]
    new = bnb_module.optim.AdamW8bit(groups)
    for gi, g in enumerate(new.param_groups):
        for pi, p in enumerate(g["params"]):
            st = opt.state.get(p)
            if not st or "exp_avg" not in st:
                continue
            new.init_state(g, p, gi, pi)  # bitsandbytes allocates the buffers its way
            s = new.state[p]
            s["step"] = int(st["step"])
            if s["state1"].dtype == torch.uint8:
                for i, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                    q, absmax = quantize_blockwise(st[key], s[f"qmap{i}"])
                    s[f"state{i}"].copy_(q.view_as(s[f"state{i}"]))
                    s[f"absmax{i}"].copy_(absmax)
            else:
                s["state1"].copy_(st["exp_avg"])
                s["state2"].copy_(st["exp_avg_sq"])
    return new


def adamw_state_from_8bit(opt8: torch.optim.Optimizer, device: torch.device | None = None) -> dict:
    """Per parameter ``{"step", "exp_avg", "exp_avg_sq"}`` (torch AdamW's layout) from an AdamW8bit."""
    out = {}
    for g in opt8.param_groups:
        for p in g["params"]:
            s = opt8.state.get(p)
            if not s or "state1" not in s:
                continue
            if s["state1"].dtype == torch.uint8:
                m = dequantize_blockwise(s["state1"], s["qmap1"], s["absmax1"])
                v = dequantize_blockwise(s["state2"], s["qmap2"], s["absmax2"])
            else:
                m, v = s["state1"].float().clone(), s["state2"].float().clone()
            dev = device or p.device
            out[p] = {
                "step": torch.tensor(float(s["step"]), dtype=torch.float32, device=p.device),
                "exp_avg": m.view_as(p).to(dev),
                "exp_avg_sq": v.view_as(p).to(dev),
            }
    return out


def to_torch_adamw(opt8: torch.optim.Optimizer, *, fused: bool, state_device=None) -> torch.optim.Optimizer:
    """torch AdamW (fused where possible) over ``opt8``'s parameters with its moments dequantised."""
    groups = [{"params": list(g["params"]), **_group_hparams(g)} for g in opt8.param_groups]
    kw: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    new = torch.optim.AdamW(groups, **kw)
    for p, st in adamw_state_from_8bit(opt8, state_device).items():
        new.state[p] = st
    return new


def is_8bit_state_dict(saved: dict[str, Any]) -> bool:
    """Whether an optimizer state dict is bitsandbytes' (``state1``/``state2``, not AdamW's moments)."""
    return any(isinstance(s, dict) and "state1" in s for s in saved.get("state", {}).values())


def adamw_state_dict_from_8bit(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> tuple[dict, int]:
    """(``saved``, a bitsandbytes AdamW8bit state dict, as a torch AdamW state dict for
    ``optimizer``, the number of parameters converted). Moments are dequantised with the code
    tables and block scales the state holds (no bitsandbytes needed); each group keeps its saved
    hyper-parameters and takes ``optimizer``'s own settings (fused, foreach, ...), which
    bitsandbytes' groups lack. A state that cannot be converted is a HydraCheckpointError."""
    current = optimizer.state_dict()["param_groups"]
    groups = []
    for i, g in enumerate(saved["param_groups"]):
        ours = {k: v for k, v in current[i].items() if k != "params"} if i < len(current) else {}
        kept = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "initial_lr") if k in g}
        groups.append({**ours, **kept, "params": g["params"]})
    state, n = {}, 0
    for key, s in saved["state"].items():
        if "state1" not in s:
            state[key] = s
            continue
        if s["state1"].dtype == torch.uint8:
            missing = [k for k in ("qmap1", "absmax1", "qmap2", "absmax2") if k not in s]
            if missing:
                raise HydraCheckpointError(
                    f"the checkpoint's 8-bit optimizer state (parameter {key}) has no {', '.join(missing)}: "
                    "not bitsandbytes' blockwise layout, so AdamW cannot continue from it; resume from a "
                    "checkpoint this version wrote (they hold AdamW's state) or start a new run"
                )
            m = dequantize_blockwise(s["state1"], s["qmap1"], s["absmax1"])
            v = dequantize_blockwise(s["state2"], s["qmap2"], s["absmax2"])
        else:  # bitsandbytes keeps small parameters' states in 32 bits
            m, v = s["state1"].float().clone(), s["state2"].float().clone()
        step = torch.tensor(float(s["step"]), dtype=torch.float32)
        state[key] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        n += 1
    return {"state": state, "param_groups": groups}, n


def is_8bit(opt: torch.optim.Optimizer) -> bool:
    return type(opt).__name__ == "AdamW8bit"


class EightBitAdam(Optimization):
    name = "8bit_adam"
    flag = "--8bit_adam"
    title = "bitsandbytes AdamW8bit (optimizer state in 8 bits), state carried over both ways"
    pretest_activation = "after_warmup"  # convert real moments, not an empty state
    pretest_extra_warmup = 1  # the first 8-bit step (conversion just done) is not timed
    probe_differs = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self._bnb = None
        self._why_not: str | None = None

    def requested(self) -> bool:
        return self.cfg.optimizations.eight_bit_adam

    def _load(self, device: torch.device) -> str | None:
        if self._bnb is not None or self._why_not is not None:
            return self._why_not
        try:
            import bitsandbytes as bnb

            from hydra_train.optim import _probe_8bit

            _probe_8bit(bnb, device)
            self._bnb = bnb
        except ImportError:
            self._why_not = "bitsandbytes is not installed (pip install 'hydra-train[8bit]')"
        except Exception as exc:  # a build that imports but cannot run here
            self._why_not = f"bitsandbytes is unusable here: {type(exc).__name__}: {str(exc)[:160]}"
        return self._why_not

    def not_applicable(self, trainer: Trainer) -> str | None:
        if trainer.device.type != "cuda":
            return "bitsandbytes' 8-bit optimizers need CUDA"
        if self.cfg.runtime.fsdp:
            return "not with --fsdp (sharded 8-bit state is not supported here)"
        return self._load(trainer.device)

    def activate(self, trainer: Trainer) -> None:
        if not is_8bit(trainer.optimizer):
            trainer.set_optimizer(to_8bit(trainer.optimizer, self._bnb))
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        if is_8bit(trainer.optimizer):
            fused = trainer.device.type in ("cuda", "cpu")
            trainer.set_optimizer(to_torch_adamw(trainer.optimizer, fused=fused))
        self.active = False
