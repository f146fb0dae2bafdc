"""kv_decode_step: one decoded token's QK norm, RoPE, cache writes, mask, length and CCGQA state in
one kernel (Triton, interpreted on CPU), against an independent fp64 oracle written with explicit
loops over rows and heads, and against the op-by-op PyTorch reference.

q_out and the written key pass hydra_kernels.numerics' criterion against the fp64 oracle (the
same-dtype reference as the yardstick); everything else the step changes (values, mask, length,
value-shift state, conv window) must equal the oracle exactly, and every position it must not
touch must be unchanged. Inputs are fresh random each test; the seed is in every failure message.
"""

import math
from dataclasses import dataclass, field

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import kv_decode as kv_mod
from hydra_kernels.ops.kv_decode import kv_decode_step, kv_decode_step_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON

STATE = ("k_cache", "v_cache", "length", "bias", "v_tail", "roll")


@dataclass
class Case:
    q: torch.Tensor  # [B, Hq, D], possibly a strided view
    k: torch.Tensor  # [B, Hkv, D]
    v: torch.Tensor  # [B, V1]
    state: dict  # the tensors the step changes (cloned per run)
    #: write, cos, sin, norm_scale, k_temperature, v_tail_next, roll_shift
    opts: dict = field(default_factory=dict)

    def fresh(self) -> dict:
        return {name: (None if t is None else t.clone()) for name, t in self.state.items()}

    def run(self, fn=kv_decode_step, **override):
        """(q_out, state after) from ``fn`` on a copy of the state."""
        st = self.fresh()
        opts = {**self.opts, **override}
        args = (self.q, self.k, self.v, st["k_cache"], st["v_cache"], st["length"], st["bias"])
        kwargs = dict(
            write=opts.get("write"), cos=opts.get("cos"), sin=opts.get("sin"),
            norm_scale=opts.get("norm_scale"), k_temperature=opts.get("k_temperature"), v_tail=st["v_tail"],
            v_tail_next=opts.get("v_tail_next"), roll=st["roll"], roll_shift=opts.get("roll_shift", 0),
        )  # fmt: skip
        if fn is kv_decode_step_ref:
            return fn(*args, *kwargs.values()), st
        return fn(*args, **kwargs), st


def make_case(
    batch: int, hq: int, hkv: int, d: int, rot: int, cache_len: int, dtype: torch.dtype, *, norm: bool,
    tail: bool, roll: bool, write: bool, strided: bool, shared_table: bool, full_row: int | None = None,
) -> Case:  # fmt: skip
    """Random inputs. ``strided``: q, k and v are slices of one wider projection row (as a decode
    step's are); ``tail``: the value's second half comes from ``v_tail`` (CCGQA's value shift);
    ``roll``: a [B, 3·w] window whose state shifts by w; ``full_row``: that row's length is the
    cache's capacity (nothing may be written)."""
    kv = hkv * d
    split = kv // 2 if tail else kv
    if strided:
        proj = torch.randn(batch, hq * d + kv + split + 7, device=DEVICE).to(dtype)
        q = proj[:, : hq * d].view(batch, hq, d)
        k = proj[:, hq * d : hq * d + kv].view(batch, hkv, d)
        v = proj[:, hq * d + kv + 7 :]
    else:
        q = torch.randn(batch, hq, d, device=DEVICE).to(dtype)
        k = torch.randn(batch, hkv, d, device=DEVICE).to(dtype)
        v = torch.randn(batch, split, device=DEVICE).to(dtype)
    length = torch.randint(0, cache_len, (batch,), device=DEVICE)
    if full_row is not None:
        length[full_row] = cache_len
    keys = torch.arange(cache_len, device=DEVICE)
    bias = torch.where(keys < length[:, None], 0.0, float("-inf")).to(dtype)
    width = 5
    state = {
        "k_cache": torch.randn(batch, hkv, cache_len, d, device=DEVICE).to(dtype),
        "v_cache": torch.randn(batch, hkv, cache_len, d, device=DEVICE).to(dtype),
        "length": length,
        "bias": bias,
        "v_tail": torch.randn(batch, kv - split, device=DEVICE).to(dtype) if tail else None,
        "roll": torch.randn(batch, 3 * width, device=DEVICE).to(dtype) if roll else None,
    }
    opts: dict = {}
    if write:
        opts["write"] = torch.rand(batch, device=DEVICE) < 0.5
    if rot:
        shape = (rot // 2,) if shared_table else (batch, rot // 2)
        angles = 3 * torch.randn(shape, device=DEVICE)
        opts["cos"], opts["sin"] = angles.cos(), angles.sin()
    if norm:
        opts["norm_scale"] = math.sqrt(d)
        opts["k_temperature"] = 0.3 * torch.randn(hkv, device=DEVICE)
    if tail:
        opts["v_tail_next"] = torch.randn(batch, kv - split, device=DEVICE).to(dtype)
    if roll:
        opts["roll_shift"] = width
    return Case(q, k, v, state, opts)


def _prepare64(x: torch.Tensor, opts: dict, temperature: torch.Tensor | None, b: int) -> torch.Tensor:
    """One row's heads [H, D] in fp64: x·√d/‖x‖ (· exp(temperature[h])), then rotate-half RoPE."""
    out = x.double().clone()
    if opts.get("norm_scale") is not None:
        for h in range(out.shape[0]):
            gain = opts["norm_scale"] / max(float(out[h].norm()), 1e-6)
            if temperature is not None:
                gain *= math.exp(float(temperature[h]))
            out[h] = out[h] * gain
    if opts.get("cos") is not None:
        cos, sin = opts["cos"].double(), opts["sin"].double()
        c, s = (cos, sin) if cos.dim() == 1 else (cos[b], sin[b])
        half = c.shape[0]
        rotated = out.clone()
        for i in range(half):
            x1, x2 = out[:, i], out[:, half + i]
            rotated[:, i] = x1 * c[i] - x2 * s[i]
            rotated[:, half + i] = x2 * c[i] + x1 * s[i]
        out = rotated
    return out


def oracle(case: Case):
    """(q_out in fp64, written keys in fp64 [B, Hkv, D], the state after the step except the
    written key rows)."""
    st = case.fresh()
    opts = case.opts
    batch, hkv, cache_len, d = st["k_cache"].shape
    q64 = torch.stack([_prepare64(case.q[b], opts, None, b) for b in range(batch)])
    k64 = torch.stack([_prepare64(case.k[b], opts, opts.get("k_temperature"), b) for b in range(batch)])
    write = opts.get("write")
    for b in range(batch):
        pos = int(st["length"][b])
        joins = True if write is None else bool(write[b])
        values = case.v[b] if st["v_tail"] is None else torch.cat([case.v[b], case.state["v_tail"][b]])
        if pos < cache_len:
            st["v_cache"][b, :, pos] = values.view(hkv, d)
            st["bias"][b, pos] = 0.0
        if joins:
            if st["v_tail"] is not None:
                st["v_tail"][b] = opts["v_tail_next"][b]
            if st["roll"] is not None:
                shift = opts["roll_shift"]
                st["roll"][b, :-shift] = case.state["roll"][b, shift:]
            st["length"][b] += 1
    return q64, k64, st


def check(case: Case, seed: int, fn=kv_decode_step):
    q_out, st = case.run(fn)
    q_ref, st_ref = case.run(kv_decode_step_ref)
    q64, k64, want = oracle(case)
    tag = f"seed={seed}"
    assert q_out.shape == case.q.shape and q_out.dtype == case.q.dtype and q_out.is_contiguous(), tag
    res = check_against_fp64(q_out, q_ref, q64, atol=fp32_noise_atol(q64), reduction="max")
    assert res.passed, f"q_out ({tag}): {res.describe()}"
    batch = case.q.shape[0]
    cache_len = st["k_cache"].shape[2]
    for b in range(batch):
        pos = int(case.state["length"][b])
        if pos < cache_len:
            got, ref = st["k_cache"][b, :, pos], st_ref["k_cache"][b, :, pos]
            res = check_against_fp64(got, ref, k64[b], atol=fp32_noise_atol(k64[b]), reduction="max")
            assert res.passed, f"key of row {b} ({tag}): {res.describe()}"
            # checked above; the rest of the cache must be untouched
            want["k_cache"][b, :, pos] = got
            st_ref["k_cache"][b, :, pos] = got
    for name in STATE:  # exact: kernel, reference and oracle
        if want[name] is not None:
            assert torch.equal(st[name], want[name]), f"{name} ({tag})"
            assert torch.equal(st_ref[name], want[name]), f"{name}, reference ({tag})"
    return q_out, st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "d", "rot"),
    [(1, 12, 4, 64, 32), (3, 6, 2, 10, 4), (2, 5, 5, 24, 24), (2, 4, 2, 12, 0)],
)
def test_ccgqa_step_matches_the_fp64_oracle(dtype, batch, hq, hkv, d, rot, seed):
    """CCGQA's step: QK norm with key temperature, partial RoPE, value from two halves, value-shift
    and conv-window state, tokens that join or not; strided projections and per-row tables."""
    case = make_case(batch, hq, hkv, d, rot, 9, dtype, norm=True, tail=True, roll=True, write=True,
                     strided=True, shared_table=False)  # fmt: skip
    check(case, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_table", [False, True])
def test_gqa_step_matches_the_fp64_oracle(dtype, shared_table, seed):
    """The dense GPT's step: full-width RoPE, no norm, the whole value from v, every token joins."""
    case = make_case(3, 8, 2, 16, 16, 7, dtype, norm=False, tail=False, roll=False, write=False,
                     strided=True, shared_table=shared_table)  # fmt: skip
    check(case, seed)


def test_contiguous_inputs_and_a_cache_wider_than_a_tile(seed):
    """Many heads (the query heads loop over tiles), contiguous inputs, a long cache."""
    case = make_case(2, 80, 16, 64, 32, 40, torch.float32, norm=True, tail=True, roll=True, write=True,
                     strided=False, shared_table=True)  # fmt: skip
    check(case, seed)


def test_a_row_whose_cache_is_full_is_not_written(seed):
    """length == capacity: the kernel writes no key, value or mask there (the reference's scatter
    would raise), the other rows step as usual."""
    case = make_case(3, 4, 2, 8, 8, 6, torch.float32, norm=True, tail=True, roll=True, write=False,
                     strided=True, shared_table=False, full_row=1)  # fmt: skip
    _, st = case.run()
    _, k64, want = oracle(case)
    for b in (0, 2):
        pos = int(case.state["length"][b])
        want["k_cache"][b, :, pos] = st["k_cache"][b, :, pos]
        torch.testing.assert_close(
            st["k_cache"][b, :, pos].double(), k64[b], rtol=1e-5, atol=1e-5, msg=f"seed={seed}"
        )
    for name in STATE:
        assert torch.equal(st[name], want[name]), f"{name} (seed={seed})"


def test_a_wrong_temperature_is_caught(seed):
    """The checks can fail: keys normed with another temperature miss the oracle."""
    case = make_case(2, 4, 2, 16, 8, 8, torch.float32, norm=True, tail=False, roll=False, write=False,
                     strided=False, shared_table=False)  # fmt: skip
    _, st = case.run(k_temperature=case.opts["k_temperature"] + 0.5)
    _, st_ref = case.run(kv_decode_step_ref)
    _, k64, _ = oracle(case)
    pos = case.state["length"]
    got, ref = (torch.stack([t["k_cache"][b, :, int(pos[b])] for b in range(2)]) for t in (st, st_ref))
    assert check_against_fp64(ref, ref, k64, atol=fp32_noise_atol(k64)).passed, f"seed={seed}"
    assert not check_against_fp64(got, ref, k64, atol=fp32_noise_atol(k64)).passed, f"seed={seed}"


def test_a_token_that_does_not_join_leaves_its_row_to_the_next(seed):
    """Two steps of one row: the first does not join (its key is written, attended by the mask,
    but length, value shift and window stay); the second joins and overwrites that position."""
    case = make_case(1, 4, 2, 8, 8, 8, torch.float32, norm=True, tail=True, roll=True, write=True,
                     strided=False, shared_table=False)  # fmt: skip
    st = case.fresh()
    pos = int(st["length"][0])
    before = {n: t.clone() for n, t in st.items()}
    opts = dict(case.opts, write=torch.tensor([False], device=DEVICE))
    kw = {n: opts[n] for n in ("cos", "sin", "norm_scale", "k_temperature", "v_tail_next", "roll_shift")}
    args = (st["k_cache"], st["v_cache"], st["length"], st["bias"])
    kv_decode_step(
        case.q, case.k, case.v, *args, write=opts["write"], v_tail=st["v_tail"], roll=st["roll"], **kw
    )
    assert int(st["length"][0]) == pos and float(st["bias"][0, pos]) == 0.0, f"seed={seed}"
    assert torch.equal(st["v_tail"], before["v_tail"]) and torch.equal(st["roll"], before["roll"]), (
        f"seed={seed}"
    )
    k2 = torch.randn_like(case.k)
    joins = torch.tensor([True], device=DEVICE)
    kv_decode_step(case.q, k2, case.v, *args, write=joins, v_tail=st["v_tail"], roll=st["roll"], **kw)
    assert int(st["length"][0]) == pos + 1, f"seed={seed}"
    again = Case(case.q, k2, case.v, before, dict(case.opts, write=joins))
    _, k64, _ = oracle(again)
    torch.testing.assert_close(
        st["k_cache"][0, :, pos].double(), k64[0], rtol=1e-5, atol=1e-5, msg=f"seed={seed}"
    )


def test_the_kernel_runs_and_the_switch_and_gradients_pick_the_reference(monkeypatch, seed):
    case = make_case(2, 4, 2, 8, 8, 8, torch.float32, norm=True, tail=True, roll=True, write=True,
                     strided=True, shared_table=False)  # fmt: skip

    def refuse(*args):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(kv_mod, "kv_decode_step_ref", refuse)
    case.run()  # the kernel
    with pytest.raises(AssertionError, match="the reference ran"):
        case.run(cos=case.opts["cos"].requires_grad_(True))
    controls.set_use_triton_kernels(False)
    with pytest.raises(AssertionError, match="the reference ran"):
        case.run()
    monkeypatch.undo()
    check(case, seed)  # the reference, switched to, steps as the oracle does


def test_bad_arguments_raise():
    case = make_case(2, 4, 2, 8, 8, 8, torch.float32, norm=True, tail=True, roll=True, write=True,
                     strided=False, shared_table=False)  # fmt: skip
    with pytest.raises(ValueError, match="length"):
        case.state["length"] = case.state["length"].int()
        case.run()
    case.state["length"] = case.state["length"].long()
    with pytest.raises(ValueError, match="v_tail"):
        case.run(v_tail_next=case.opts["v_tail_next"][:, :-1])
    with pytest.raises(ValueError, match="write"):
        case.run(write=case.opts["write"].long())
    with pytest.raises(ValueError, match="cos/sin"):
        case.run(cos=case.opts["cos"][:1], sin=case.opts["sin"][:1])
    with pytest.raises(ValueError, match="k_temperature"):
        case.run(k_temperature=case.opts["k_temperature"][:1])


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below): CCGQA's and the dense
    GPT's configurations at the 100M preset's shapes."""
    names = ["Q", "K", "V", "V_TAIL", "V_NEXT", "COS", "SIN", "TEMP", "K_CACHE", "V_CACHE", "LENGTH", "BIAS",
             "WRITE", "Q_OUT", "ROLL"]  # fmt: skip
    types = ["*bf16"] * 5 + ["*fp32", "*fp32"] + ["*bf16"] * 3 + ["*i64", "*bf16", "*i1", "*bf16", "*bf16"]
    sig = dict(zip(names, types, strict=True))
    for s in ("qb", "qh", "kb", "kh", "vb", "tailb", "nextb", "tb", "cb", "ch", "cl", "len", "biasb", "write",
              "rollb"):  # fmt: skip
        sig[f"stride_{s}"] = "i32"
    sig.update(cache_len="i32", scale="fp32", eps_sq="fp32")
    ccgqa = dict(HQ=12, HKV=4, HEAD_DIM=64, BLOCK_HQ=16, BLOCK_HKV=4, BLOCK_D=64, HALF=16, NORM=True,
                 HAS_TEMP=True, V_SPLIT=128, BLOCK_V=256, HAS_TAIL=True, HAS_NEXT=True, HAS_WRITE=True,
                 ROLL_KEEP=2048, ROLL_SHIFT=1024, BLOCK_ROLL=1024)  # fmt: skip
    gqa = dict(ccgqa, NORM=False, HAS_TEMP=False, HALF=32, V_SPLIT=256, HAS_TAIL=False, HAS_NEXT=False,
               HAS_WRITE=False, ROLL_KEEP=0, ROLL_SHIFT=0, BLOCK_ROLL=1)  # fmt: skip
    for consts in (ccgqa, gqa):
        build_sm90(kv_mod._kv_decode_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
