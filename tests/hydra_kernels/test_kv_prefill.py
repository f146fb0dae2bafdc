"""kv_prefill_: a prefill's attention cache (keys, values, mask, lengths) in one kernel (Triton,
interpreted on the CPU), against a loop over sequences, heads and positions written here (copies
and constants: the same bits); fresh random keys, values and counts (0 and n included), strided
k/v as attention leaves them, leftover values in reused buffers; the seed is in every failure
message."""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import kv_prefill as kp_mod
from hydra_kernels.ops.kv_prefill import kv_prefill_, kv_prefill_ref_

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _by_loop(k, v, capacity, count):
    b, h, n, d = k.shape
    kc, vc = torch.zeros(b, h, capacity, d, dtype=k.dtype), torch.zeros(b, h, capacity, d, dtype=v.dtype)
    bias = torch.full((b, capacity), float("-inf"), dtype=k.dtype)
    length = torch.full((b,), n) if count is None else count.long().clone()
    for i in range(b):
        for s in range(n):
            kc[i, :, s], vc[i, :, s] = k[i, :, s], v[i, :, s]
        bias[i, : int(length[i])] = 0
    return kc, vc, bias, length


def _garbage(shape, dtype):
    """A reused buffer's leftovers (NaN among them): whatever is not written must not survive."""
    t = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 99, shape)
    if dtype.is_floating_point:
        t.view(-1)[::7] = float("nan")
    return t.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "n", "d", "capacity", "counted"), [
    (1, 2, 7, 16, 12, False), (3, 3, 9, 24, 80, True), (2, 1, 5, 64, 5, True), (4, 2, 1, 8, 300, True),
    (2, 2, 5, 64, 1000, True),  # the positions in 16 blocks of programs
])  # fmt: skip
def test_kv_prefill_writes_the_cache_of_its_definition(seed, dtype, b, h, n, d, capacity, counted):
    # k, v as attention has them: [B, n, H, d] transposed to [B, H, n, d] (strided)
    k = torch.randn(b, n, h, d).to(dtype).transpose(1, 2)
    v = torch.randn(b, n, h, d).to(dtype).transpose(1, 2)
    count = None
    if counted:
        count = torch.randint(0, n + 1, (b,))
        count[0] = n
        if b > 1:
            count[1] = 0
    want = _by_loop(k, v, capacity, count)
    outs = [_garbage((b, h, capacity, d), dtype), _garbage((b, h, capacity, d), dtype),
            _garbage((b, capacity), dtype), _garbage((b,), torch.long)]  # fmt: skip
    falls = controls.fallback_counts().get("kv_prefill", 0)
    kv_prefill_(k.to(DEVICE), v.to(DEVICE), *outs, None if count is None else count.to(DEVICE))
    assert controls.fallback_counts().get("kv_prefill", 0) == falls  # the kernel ran
    ref = [torch.empty_like(w) for w in want]
    kv_prefill_ref_(k, v, *ref, count)
    for name, got, r, w in zip(("k_cache", "v_cache", "bias", "length"), outs, ref, want, strict=True):
        assert torch.equal(got.cpu(), w), f"seed {seed}: {name}"
        assert torch.equal(r, w), f"seed {seed}: reference {name}"


def test_switched_off_it_runs_the_reference_and_bad_inputs_raise():
    k = torch.randn(2, 2, 3, 8, device=DEVICE)
    outs = [torch.empty(2, 2, 5, 8, device=DEVICE), torch.empty(2, 2, 5, 8, device=DEVICE),
            torch.empty(2, 5, device=DEVICE), torch.empty(2, dtype=torch.long, device=DEVICE)]  # fmt: skip
    controls.set_op_enabled("kv_prefill", False)
    kv_prefill_(k, k, *outs)
    want = _by_loop(k.cpu(), k.cpu(), 5, None)
    assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, want, strict=True))
    with pytest.raises(ValueError, match="caches \\[B, H, L ≥ n, d\\]"):
        kv_prefill_(k, k, outs[0][:, :, :2], outs[1][:, :, :2], outs[2][:, :2], outs[3])
    with pytest.raises(ValueError, match="length \\[B\\] long"):
        kv_prefill_(k, k, *outs[:3], outs[3].int())


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"K": "*bf16", "V": "*bf16", "KC": "*bf16", "VC": "*bf16", "BIAS": "*bf16", "LEN": "*i64",
           "COUNT": "*i64", "n": "i32", "capacity": "i32", "heads": "i32", "stride_kb": "i32",
           "stride_kh": "i32", "stride_kn": "i32", "stride_vb": "i32", "stride_vh": "i32",
           "stride_vn": "i32"}  # fmt: skip
    consts = {"D": 64, "BLOCK_D": 64, "BLOCK_S": 64, "HAS_COUNT": True}
    build_sm90(kp_mod._kv_prefill_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)


def test_inside_torch_compile_the_reference_runs_and_traces_as_one_graph():
    """A raw Triton launch would break the graph: compiled, the op runs its reference (fullgraph)."""
    k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    count = torch.tensor([3, 1])

    def fill(k, v, count):
        outs = [torch.empty(2, 2, 6, 8), torch.empty(2, 2, 6, 8), torch.empty(2, 6)]
        outs.append(torch.empty(2, dtype=torch.long))
        kv_prefill_(k, v, *outs, count)
        return outs

    torch._dynamo.reset()
    got = torch.compile(fill, backend="aot_eager", fullgraph=True)(k, v, count)
    want = _by_loop(k, v, 6, count)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
