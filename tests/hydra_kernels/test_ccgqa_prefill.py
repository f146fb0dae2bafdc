"""ccgqa_prefill: a CCGQA prefill's window, shifted values, conv state and value-shift source in one
kernel (Triton, interpreted on the CPU), against loops over sequences and tokens written here
(copies: the same bits); fresh random projections and lengths (0 and n included), a strided
projection, strided state outputs, no context; the seed is in every failure message."""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import ccgqa_prefill as cp_mod
from hydra_kernels.ops.ccgqa_prefill import ccgqa_prefill, ccgqa_prefill_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _by_loop(proj: torch.Tensor, c: int, ctx: int, length: torch.Tensor | None):
    """The four outputs element by element from the definitions."""
    b, n, width = proj.shape
    half = (width - c) // 2
    window = torch.zeros(b, ctx + n, c, dtype=proj.dtype)
    v = torch.zeros(b, n, 2 * half, dtype=proj.dtype)
    state = torch.zeros(b, ctx, c, dtype=proj.dtype)
    prev = torch.zeros(b, half, dtype=proj.dtype)
    for i in range(b):
        real = n if length is None else int(length[i])
        for t in range(n):
            window[i, ctx + t] = proj[i, t, :c]
            v[i, t, :half] = proj[i, t, c : c + half]
            if t:
                v[i, t, half:] = proj[i, t - 1, c + half :]
        for s in range(ctx):
            if real - ctx + s >= 0:
                state[i, s] = proj[i, real - ctx + s, :c]
        if real:
            prev[i] = proj[i, real - 1, c + half :]
    return window, v, state.reshape(b, ctx * c), prev


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "n", "c", "kv", "ctx", "strided", "lengths"), [
    (1, 7, 48, 32, 2, False, False), (3, 9, 200, 64, 3, True, True), (4, 5, 40, 1100, 1, True, True),
    (2, 1, 16, 8, 2, False, True), (3, 6, 24, 16, 0, False, True),
])  # fmt: skip
def test_ccgqa_prefill_gives_the_definitions_copies(seed, dtype, b, n, c, kv, ctx, strided, lengths):
    wide = torch.randn(b, n, c + kv + (24 if strided else 0)).to(dtype)
    proj = wide[..., 8 : 8 + c + kv] if strided else wide  # a slice of a wider tensor
    length = None
    if lengths:
        length = torch.randint(0, n + 1, (b,))
        length[0] = n  # every row real
        length[1] = 0  # none: zeros
    want = _by_loop(proj, c, ctx, length)
    dev_len = None if length is None else length.to(DEVICE)
    falls = controls.fallback_counts().get("ccgqa_prefill", 0)
    got = ccgqa_prefill(proj.to(DEVICE), c, ctx, dev_len, state=True)
    assert controls.fallback_counts().get("ccgqa_prefill", 0) == falls  # the kernel ran
    ref = ccgqa_prefill_ref(proj, c, ctx, length, state=True)
    for name, g, r, w in zip(("window", "v", "state", "prev"), got, ref, want, strict=True):
        assert torch.equal(g.cpu(), w), f"seed {seed}: {name}"
        assert torch.equal(r, w), f"seed {seed}: reference {name}"
    # the state alone, into strided outputs (the first columns of wider buffers), the rest untouched
    rows = torch.full((b, ctx * c + 5), 7.0, dtype=dtype, device=DEVICE)
    prev = torch.full((b, kv // 2 + 3), 7.0, dtype=dtype, device=DEVICE)
    only = ccgqa_prefill(proj.to(DEVICE), c, ctx, dev_len, views=False, state=True,
                         state_out=rows[:, : ctx * c], prev_out=prev[:, : kv // 2])  # fmt: skip
    assert only.window is None and only.v is None
    assert torch.equal(rows[:, : ctx * c].cpu(), want[2]), f"seed {seed}"
    assert torch.equal(prev[:, : kv // 2].cpu(), want[3]), f"seed {seed}"
    assert bool((rows[:, ctx * c :] == 7).all()) and bool((prev[:, kv // 2 :] == 7).all()), f"seed {seed}"


def test_switched_off_it_runs_the_reference_and_bad_inputs_raise():
    proj, length = torch.randn(2, 5, 8 + 6, device=DEVICE), torch.tensor([3, 5], device=DEVICE)
    controls.set_op_enabled("ccgqa_prefill", False)
    got = ccgqa_prefill(proj, 8, 2, length, state=True)
    ref = ccgqa_prefill_ref(proj, 8, 2, length, state=True)
    assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
    with pytest.raises(ValueError, match="length must be"):
        ccgqa_prefill(proj, 8, 2, length.float())
    with pytest.raises(ValueError, match="n >= 1"):
        ccgqa_prefill(proj[:, :0], 8, 2)
    with pytest.raises(ValueError, match="must be even"):
        ccgqa_prefill(proj, 9, 2)
    with pytest.raises(ValueError, match="state_out must be"):
        ccgqa_prefill(proj, 8, 2, length, state=True, state_out=torch.empty(2, 15, device=DEVICE))


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"P": "*bf16", "WIN": "*bf16", "V": "*bf16", "STATE": "*bf16", "PREV": "*bf16", "LEN": "*i64",
           "n": "i32", "per_win": "i32", "per_v": "i32", "total_win": "i64", "total_v": "i64",
           "total_state": "i32", "total_prev": "i32", "stride_pb": "i32", "stride_pt": "i32",
           "stride_sb": "i32", "stride_qb": "i32", "PROGS_WIN": "i32", "PROGS_V": "i32",
           "PROGS_STATE": "i32"}  # fmt: skip
    consts = {"C": 1024, "KV": 256, "CTX": 2, "HAS_LEN": True, "BLOCK": cp_mod.BLOCK}
    build_sm90(cp_mod._ccgqa_prefill_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)


def test_inside_torch_compile_the_reference_runs_and_traces_as_one_graph():
    """A raw Triton launch would break the graph: compiled, the op runs its reference (fullgraph)."""
    proj, length = torch.randn(2, 5, 8 + 6), torch.tensor([3, 5])
    torch._dynamo.reset()

    def copies(p, n):
        return ccgqa_prefill(p, 8, 2, n, state=True)

    got = torch.compile(copies, backend="aot_eager", fullgraph=True)(proj, length)
    want = _by_loop(proj, 8, 2, length)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="2^31 elements: a GPU's memory")
def test_an_output_past_2_31_elements_is_copied_whole_on_cuda():
    """Element counts past int32 (the window here: 2.3e9) come from the host: an in-kernel product
    of int32 arguments wrapped and masked every store, leaving the output uninitialised."""
    proj = torch.randn(1, 140000, 16416, dtype=torch.bfloat16, device="cuda")
    got = ccgqa_prefill(proj, 16384, 2)
    assert got.window.numel() >= 2**31
    assert torch.equal(got.window[0, 2:], proj[0, :, :16384]) and not got.window[0, :2].any()
    assert torch.equal(got.v[0, :, :16], proj[0, :, 16384:16400])
