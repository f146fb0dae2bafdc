"""The copies a CCGQA prefill makes of its projection, in one kernel (no autograd).

Why: a forward without gradients through hydra_model's CCGQA attention (ccgqa.py; a prompt's
prefill or an evaluation forward) takes its projection ``proj = [u | v₁ | v₂]`` (per token: the
C pre-conv q/k channels, then the two halves of the values) apart into

- the conv's window: u with ``context`` rows of zeros in front of each sequence;
- the shifted values: ``v[t] = [v₁[t] | v₂[t−1]]`` (zeros for t = 0);

and a prefill keeps, per sequence, the conv's state (the last ``context`` real rows of u, zeros
before the first) and the value shift's source (the last real row of v₂). Op by op that is a pad,
a pad and a cat, and two gathers: five launches a block at batch 1, where a prefill is bound by
its host launches. Here it is one.

For each sequence b with ``length[b]`` real rows at the front (all n when ``length`` is None):

    window[b, s, c] = u[b, s − context, c]       (0 where s < context)
    v[b, t, j]      = proj[b, t − (j ≥ kv/2), C + j]   (0 where that row is −1)
    state[b, s·C + c] = u[b, length[b] − context + s, c]   (0 where that row is negative)
    prev[b, c]        = v₂[b, length[b] − 1, c]            (0 where length[b] = 0)

Faces: the PyTorch reference :func:`ccgqa_prefill_ref` (the op-by-op form), the Triton kernel
``_ccgqa_prefill_kernel`` (a tile of one output a program; the programs of the four outputs side
by side in one grid) with its launcher :func:`ccgqa_prefill_launch`, and :func:`ccgqa_prefill`,
which runs the kernel where hydra_kernels' Triton path is on for proj's device (CUDA, or the CPU
under ``TRITON_INTERPRET=1``) and the reference elsewhere. Copies only: both give the same bits.
Nothing is read on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import cdiv, check_devices, compiling, device_guard, run_with_fallback
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Output elements a program copies.
BLOCK = 1024


class PrefillCopies(NamedTuple):
    """The outputs: ``window`` [B, context + n, C] and ``v`` [B, n, kv] (None when not asked
    for), ``state`` [B, context·C] and ``prev`` [B, kv/2] (None without ``state``)."""

    window: torch.Tensor | None
    v: torch.Tensor | None
    state: torch.Tensor | None
    prev: torch.Tensor | None


# --- PyTorch reference ---------------------------------------------------------------------------


def shifted_values(proj: torch.Tensor, qk_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, v) of proj [B, n, C + KV] op by op, differentiable: u [B, n, C] a view, and the shifted
    values v [B, n, KV] = [v₁[t] | v₂[t−1]] (zeros for t = 0): the reference's v, and what CCGQA's
    training forward takes (its conv kernels read u in place)."""
    n = proj.shape[1]
    half = (proj.shape[2] - qk_channels) // 2
    u, v_cur, src = proj.split([qk_channels, half, half], dim=-1)
    return u, torch.cat([v_cur, F.pad(src[:, : n - 1], (0, 0, 1, 0))], dim=-1)


def _tail_rows(src: torch.Tensor, length: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, rows·C]: each sequence's last ``rows`` of its first length[b] rows, zeros before row 0."""
    b, _, c = src.shape
    padded = F.pad(src, (0, 0, rows, 0))  # padded row length + s is row length − rows + s
    idx = length.long().view(b, 1) + torch.arange(rows, device=src.device).view(1, -1)
    return padded.gather(1, idx.unsqueeze(-1).expand(b, rows, c)).reshape(b, rows * c)


def ccgqa_prefill_ref(
    proj: torch.Tensor, qk_channels: int, context: int, length: torch.Tensor | None = None,
    *, views: bool = True, state: bool = False,
) -> PrefillCopies:  # fmt: skip
    """The outputs op by op (see the module docstring)."""
    b, n, _ = proj.shape
    half = (proj.shape[2] - qk_channels) // 2
    u, _, src = proj.split([qk_channels, half, half], dim=-1)
    window = v = tail = prev = None
    if views:
        window = F.pad(u, (0, 0, context, 0))
        v = shifted_values(proj, qk_channels)[1]
    if state:
        if length is None:
            length = torch.full((b,), n, dtype=torch.long, device=proj.device)
        tail, prev = _tail_rows(u, length, context), _tail_rows(src, length, 1)
    return PrefillCopies(window, v, tail, prev)


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _ccgqa_prefill_kernel(
    P, WIN, V, STATE, PREV, LEN, n, per_win, per_v, total_win, total_v, total_state, total_prev,
    stride_pb, stride_pt, stride_sb, stride_qb, PROGS_WIN, PROGS_V, PROGS_STATE,
    C: tl.constexpr, KV: tl.constexpr, CTX: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One flat grid: the window's programs, then the values', the state's, then prev's (the
    # launcher gives each output its share). A program copies BLOCK consecutive elements of one
    # output; masked loads give the zeros. Element counts come from the host (per sequence and in
    # all): they may pass 2^31, where a product of int32 arguments would wrap.
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    half = KV // 2
    if pid < PROGS_WIN:  # window [B, CTX + n, C]
        q = pid.to(tl.int64) * BLOCK + lane
        inside = q < total_win
        b = q // per_win
        t = (q % per_win) // C - CTX
        c = q % C
        val = tl.load(P + b * stride_pb + t * stride_pt + c, mask=inside & (t >= 0), other=0.0)
        tl.store(WIN + q, val, mask=inside)
    elif pid < PROGS_WIN + PROGS_V:  # v [B, n, KV]: the second half one row back
        q = (pid - PROGS_WIN).to(tl.int64) * BLOCK + lane
        inside = q < total_v
        b = q // per_v
        j = q % KV
        t = (q % per_v) // KV - (j >= half).to(tl.int64)
        val = tl.load(P + b * stride_pb + t * stride_pt + C + j, mask=inside & (t >= 0), other=0.0)
        tl.store(V + q, val, mask=inside)
    elif pid < PROGS_WIN + PROGS_V + PROGS_STATE:  # state [B, CTX·C]: the last CTX real rows of u
        per = CTX * C
        q = (pid - PROGS_WIN - PROGS_V).to(tl.int64) * BLOCK + lane
        inside = q < total_state
        b = q // per
        real = tl.load(LEN + b, mask=inside, other=0).to(tl.int64) if HAS_LEN else n
        t = real - CTX + (q % per) // C
        c = q % C
        ok = inside & (t >= 0) & (t < n)
        val = tl.load(P + b * stride_pb + t * stride_pt + c, mask=ok, other=0.0)
        tl.store(STATE + b * stride_sb + q % per, val, mask=inside)
    else:  # prev [B, KV/2]: the last real row of v₂
        q = (pid - PROGS_WIN - PROGS_V - PROGS_STATE).to(tl.int64) * BLOCK + lane
        inside = q < total_prev
        b = q // half
        c = q % half
        t = (tl.load(LEN + b, mask=inside, other=0).to(tl.int64) if HAS_LEN else n + lane * 0) - 1
        ok = inside & (t >= 0) & (t < n)
        val = tl.load(P + b * stride_pb + t * stride_pt + C + half + c, mask=ok, other=0.0)
        tl.store(PREV + b * stride_qb + c, val, mask=inside)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def ccgqa_prefill_launch(
    proj: torch.Tensor, qk_channels: int, context: int, length: torch.Tensor | None,
    window: torch.Tensor | None, v: torch.Tensor | None, state: torch.Tensor | None,
    prev: torch.Tensor | None,
) -> None:  # fmt: skip
    """Launch the kernel (arguments checked by :func:`ccgqa_prefill`): proj with unit column
    stride; window and v contiguous; state and prev with unit column stride; length contiguous.
    The outputs not wanted are None (views: window and v both or neither; state: both or neither)."""
    b, n, width = proj.shape
    kv = width - qk_channels
    per_win, per_v = (n + context) * qk_channels, n * kv
    totals = [
        b * per_win if window is not None else 0,
        b * per_v if v is not None else 0,
        b * context * qk_channels if state is not None else 0,
        b * (kv // 2) if prev is not None else 0,
    ]
    progs_win, progs_v, progs_state, progs_prev = (cdiv(t, BLOCK) for t in totals)
    total = progs_win + progs_v + progs_state + progs_prev
    if total == 0:
        return
    stride_sb = state.stride(0) if state is not None else 0
    stride_qb = prev.stride(0) if prev is not None else 0
    key = (b, n, qk_channels, kv, context, proj.stride(0), proj.stride(1), stride_sb, stride_qb,
           window is not None, state is not None, length is not None,
           None if length is None else length.dtype, proj.dtype, proj.get_device())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        consts = {"C": qk_channels, "KV": kv, "CTX": context, "HAS_LEN": length is not None, "BLOCK": BLOCK}
        plan = _PLANS[key] = LaunchPlan(_ccgqa_prefill_kernel, (total,), consts, 4, 1, proj.get_device())
    # an absent output's pointer: any tensor (its programs are not launched)
    args = [t if t is not None else proj for t in (window, v, state, prev, length)]
    with device_guard(proj):
        plan(proj, *args, n, per_win, per_v, *totals, proj.stride(0), proj.stride(1), stride_sb,
             stride_qb, progs_win, progs_v, progs_state)  # fmt: skip


# --- public function -----------------------------------------------------------------------------


def ccgqa_prefill(
    proj: torch.Tensor,
    qk_channels: int,
    context: int,
    length: torch.Tensor | None = None,
    *,
    views: bool = True,
    state: bool = False,
    state_out: torch.Tensor | None = None,
    prev_out: torch.Tensor | None = None,
) -> PrefillCopies:
    """proj [B, n, C + kv] (C = ``qk_channels``, kv even; any strides) → the window and the
    shifted values (``views``) and, with ``state``, each sequence's conv state and value-shift
    source after its ``length[b]`` real rows (``length`` [B] integers in [0, n]; None: all n).
    ``state_out`` [B, context·C] / ``prev_out`` [B, kv/2] (proj's dtype, unit column stride):
    where those are written, else new tensors. The Triton kernel runs where hydra_kernels'
    Triton path is on for proj's device; a switched-off path or another device run
    :func:`ccgqa_prefill_ref`. No autograd."""
    if proj.dim() != 3 or proj.shape[1] < 1 or not 0 <= qk_channels <= proj.shape[2] or context < 0:
        raise ValueError(f"ccgqa_prefill: proj [B, n >= 1, C + kv] with 0 <= C, context >= 0; got "
                         f"{tuple(proj.shape)}, qk_channels={qk_channels}, context={context}")  # fmt: skip
    b, n, width = proj.shape
    kv = width - qk_channels
    if kv % 2:
        raise ValueError(f"ccgqa_prefill: the values' width {kv} (proj's {width} − C {qk_channels}) "
                         "must be even")  # fmt: skip
    if length is not None and (length.shape != (b,) or length.is_floating_point()):
        raise ValueError(f"ccgqa_prefill: length must be [{b}] integers, got {tuple(length.shape)} "
                         f"{length.dtype}")  # fmt: skip
    wanted = (("state_out", state_out, (b, context * qk_channels)), ("prev_out", prev_out, (b, kv // 2)))
    for name, out, shape in wanted:
        if out is not None and (not state or out.shape != shape or out.dtype != proj.dtype):
            raise ValueError(f"ccgqa_prefill: {name} must be {list(shape)} {proj.dtype} with state=True, "
                             f"got {tuple(out.shape)} {out.dtype}")  # fmt: skip
    check_devices("ccgqa_prefill", "proj length state_out prev_out", proj, length, state_out, prev_out)
    # inside torch.compile the reference (a raw launch would break the graph; the compiler fuses it)
    kernel = (
        not compiling()
        and controls.triton_path("ccgqa_prefill", proj)
        and all(o is None or o.stride(1) == 1 for o in (state_out, prev_out))
    )

    def reference(out: PrefillCopies) -> PrefillCopies:
        # a new tuple, not ref._replace: torch 2.11's torch.compile cannot trace _replace
        ref = ccgqa_prefill_ref(proj, qk_channels, context, length, views=views, state=state)
        return PrefillCopies(*(_into(o, r) for o, r in zip(out, ref, strict=True)))

    if not kernel:
        return reference(PrefillCopies(None, None, state_out, prev_out))
    if width and proj.stride(2) != 1:
        proj = proj.contiguous()
    if length is not None:
        length = length.contiguous()

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=proj.dtype, device=proj.device)

    out = PrefillCopies(
        new(b, context + n, qk_channels) if views else None,
        new(b, n, kv) if views else None,
        (state_out if state_out is not None else new(b, context * qk_channels)) if state else None,
        (prev_out if prev_out is not None else new(b, kv // 2)) if state else None,
    )

    def launch() -> PrefillCopies:
        ccgqa_prefill_launch(proj, qk_channels, context, length, *out)
        return out

    return run_with_fallback("ccgqa_prefill", launch, lambda: reference(out))


def _into(out: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor | None:
    """``value`` written into ``out`` where there is one, else ``value`` itself."""
    return value if out is None or value is None else out.copy_(value)
