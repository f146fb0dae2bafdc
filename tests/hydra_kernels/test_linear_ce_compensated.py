"""linear_cross_entropy with ``dw_accum="compensated"``: dW in its own 16-bit tensor plus a
4-bit residual per element (ops/_linear_ce_compensated.py).

Checked here: the project criterion against float64 on the Triton path (interpreted) and the
PyTorch twin, with many chunks, odd widths and fp16; the accumulator against an exact fp64 sum
and against bf16 accumulation; the Triton kernel against its twin bit for bit; the memory the call
really allocates (every storage an aten op creates, tracked while alive) against the formula of
``workspace_bytes``, and the automatic chunk against twice Liger's workspace; that the kernel
builds for sm_90 with its token loop pipelined; the bench scripts' CPU runs. (torch.compile
tracing of this mode: test_linear_cross_entropy.test_compile_fullgraph_without_graph_breaks.)
"""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hydra_kernels import controls
from hydra_kernels.ops import _linear_ce_chunks as chunks
from hydra_kernels.ops import _linear_ce_compensated as comp
from hydra_kernels.ops.linear_cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_ref,
    set_linear_ce_options,
)

from .conftest import build_sm90, run_without_interpreter
from .test_linear_cross_entropy import _assert_criterion, _check, _clean_state, _inputs, _run  # noqa: F401

OP = "linear_cross_entropy"
pytestmark = pytest.mark.skipif(not controls.INTERPRETER_ACTIVE, reason="needs TRITON_INTERPRET=1 (CPU CI)")


@pytest.mark.parametrize(
    ("dtype", "reduction", "z_loss", "chunk", "triton", "d"),
    [
        (torch.bfloat16, "mean", 1e-3, 16, True, 48),  # 3 chunks, the last one partial
        (torch.bfloat16, "none", 1e-3, 4, True, 48),  # 10 chunks, recomputed in the backward
        (torch.float16, "sum", 0.0, 8, True, 48),  # fp16: 10 mantissa bits, subnormal quantum
        (torch.bfloat16, "mean", 1e-3, 8, True, 47),  # odd D: the masked (non-EVEN) kernel path
        (torch.bfloat16, "sum", 0.0, 2, False, 48),  # 19 chunks in the PyTorch twin
        (torch.bfloat16, "mean", 0.0, 0, True, 48),  # the automatic chunk
    ],
)
def test_compensated_meets_fp64_criterion(dtype, reduction, z_loss, chunk, triton, d):
    set_linear_ce_options(chunk_rows=chunk, dw_accum="compensated")
    controls.set_op_enabled(OP, triton)
    h, w, y = _inputs(31 + chunk + d, d=d)
    got = _assert_criterion(h, w, y, dtype, reduction, z_loss)
    assert got[2].dtype == dtype  # the gradient is the accumulator: nothing converted at the end
    assert controls.fallback_counts()[OP] == 0


def test_many_chunks_compensated_keeps_the_precision_bf16_accumulation_loses():
    """64 chunks (PyTorch twin, to keep the interpreter out of a 64-launch run): the compensated
    dW passes the criterion and its errors are of torch's size, where rounding the running sum to
    bf16 after each chunk (``dw_accum="input"``) fails the criterion."""
    controls.set_op_enabled(OP, False)
    h, w, y = _inputs(41, n=256)
    same = _run(linear_cross_entropy_ref, h, w, y, torch.bfloat16, "mean", 0.0)[2]
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, "mean", 0.0)[2]
    from hydra_kernels.ops.linear_cross_entropy import grad_rounding_atol

    flip_dw = grad_rounding_atol(h, w, y, torch.bfloat16)[1]
    got = {}
    for mode in ("compensated", "input"):
        set_linear_ce_options(chunk_rows=4, dw_accum=mode)
        got[mode] = _run(linear_cross_entropy, h, w, y, torch.bfloat16, "mean", 0.0)[2]
    assert _check(got["compensated"], same, ref, flip_dw)
    assert not _check(got["input"], same, ref, flip_dw)
    torch_err = (same.double() - ref).abs().mean()
    assert (got["compensated"].double() - ref).abs().mean() <= 1.1 * torch_err


def _decode(hi: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
    """hi + n·ulp(hi)/16 in float64, decoded independently of the module (frexp, no bit masks)."""
    d = hi.shape[1]
    half = plane.shape[1]
    byte = plane.to(torch.int64)
    codes = torch.cat([byte & 15, (byte >> 4) & 15], dim=1)[:, :d]
    codes = torch.where(codes >= 8, codes - 16, codes).double()
    hf = hi.double()
    mant = 7 if hi.dtype == torch.bfloat16 else 10
    emin = -126 if hi.dtype == torch.bfloat16 else -14
    exp = torch.frexp(hf)[1].to(torch.int64) - 1  # |hf| in [2^exp, 2^(exp+1))
    exp = torch.where(hf == 0, torch.full_like(exp, emin), exp).clamp_min(emin)
    assert half == (d + 1) // 2
    return hf + codes * torch.pow(2.0, (exp - mant - 4).double())


@pytest.mark.parametrize(("dtype", "v", "d"), [(torch.bfloat16, 301, 49), (torch.float16, 256, 64)])
def test_kernel_accumulates_to_the_exact_sum(dtype, v, d):
    """Seven chunks of G_cᵀ h_c: the decoded running sum of the Triton kernel and of its PyTorch twin
    each stays within the accumulator's own rounding of the exact fp64 sum: per chunk half a
    residual quantum (ulp/32) plus fp32 roundings of the chunk's product and sum."""
    gen = torch.Generator().manual_seed(5)
    c, k = 16, 7
    hi_t, lo_t = torch.empty(v, d, dtype=dtype), torch.empty(comp.plane_shape(v, d), dtype=torch.uint8)
    hi_p, lo_p = hi_t.clone(), lo_t.clone()
    exact = torch.zeros(v, d, dtype=torch.float64)
    bound = torch.zeros(v, d, dtype=torch.float64)
    for step in range(k):
        g = (1e-2 * torch.randn(c, v, generator=gen)).to(dtype)
        h = torch.randn(c, d, generator=gen).to(dtype)
        comp.launch_dw_compensated(hi_t, lo_t, g, h, step == 0, c)
        comp.accumulate_compensated_torch(hi_p, lo_p, g, h, step == 0)
        terms = g.double().t().abs() @ h.double().abs()
        exact += g.double().t() @ h.double()
        # residual quantum ≤ |sum|·2^-11, half of it lost; fp32: product (c terms) and the add
        bound += 2.0**-12 * (exact.abs() + bound) + (c + 2) * 2.0**-24 * (terms + exact.abs() + bound)
    ulp_bits = 7 if dtype == torch.bfloat16 else 10
    for hi, lo in ((hi_t, lo_t), (hi_p, lo_p)):
        err = (_decode(hi, lo) - exact).abs()
        assert (err <= bound).all(), float((err / bound).max())
        # the gradient itself is the running sum rounded to the 16-bit format: within 1/2 ulp + bound
        ulp = torch.pow(2.0, (torch.frexp(hi.double())[1] - 1 - ulp_bits).double())
        assert ((hi.double() - exact).abs() <= 0.5 * ulp + 2 * bound + 1e-30).all()


@pytest.mark.parametrize(("dtype", "v", "d"), [(torch.bfloat16, 301, 49), (torch.float16, 256, 64)])
def test_kernel_matches_its_twin_bit_for_bit(dtype, v, d):
    """The Triton kernel and the PyTorch twin write the same bits, chunk after chunk. The chunk
    products are made exact in fp32 (small integers times 2^-10, 16 terms), so no summation order
    of the matrix product can change them (the interpreter's numpy and torch's CPU matmul sum in
    different orders, and with random data their last bits differ on some BLAS builds); what is
    compared is the compensated accumulation, whose running sum outgrows the 16-bit format."""
    gen = torch.Generator().manual_seed(6)
    c, k = 16, 7
    hi_t, lo_t = torch.empty(v, d, dtype=dtype), torch.empty(comp.plane_shape(v, d), dtype=torch.uint8)
    hi_p, lo_p = hi_t.clone(), lo_t.clone()
    for step in range(k):
        g = (torch.randint(-64, 65, (c, v), generator=gen) * 2.0**-10).to(dtype)  # exact in both
        h = torch.randint(-64, 65, (c, d), generator=gen).to(dtype)
        comp.launch_dw_compensated(hi_t, lo_t, g, h, step == 0, c)
        comp.accumulate_compensated_torch(hi_p, lo_p, g, h, step == 0)
        assert torch.equal(hi_t, hi_p) and torch.equal(lo_t, lo_p), step
    # the residual planes were used: the running sums do not fit the 16-bit format
    assert (lo_t != 0).any() and not torch.equal(hi_t.double(), _decode(hi_t, lo_t))


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by aten ops while they are alive, leaving out the given
    tensors' storages. Frees are noticed before the next op; before a new storage of 1 kB or more
    is counted, garbage is collected, so that what only reference cycles keep (the Triton
    interpreter's launches make such cycles; a GPU launch does not) counts as freed."""

    def __init__(self, *exclude: torch.Tensor):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.exclude:
                    if storage.nbytes() >= 1024:
                        gc.collect()
                        self._sweep()
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


@pytest.mark.parametrize(("reduction", "frozen_weight"), [("mean", False), ("none", False), ("sum", True)])
def test_workspace_follows_the_formula(reduction, frozen_weight):
    """Forward + backward allocate the gradients plus exactly ``workspace_bytes`` (logits buffer,
    residual plane when dW is computed, fp32 per-token losses) and a few bytes of scalars and the
    ignore mask — nothing [V, D]-sized in fp32, no copy of the gradients."""
    n, d, v, rows = 300, 48, 1001, 64
    set_linear_ce_options(chunk_rows=rows, dw_accum="compensated")
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(n, d, generator=gen).bfloat16().requires_grad_()
    w = (0.1 * torch.randn(v, d, generator=gen)).bfloat16().requires_grad_(not frozen_weight)
    y = torch.randint(0, v, (n,), generator=gen)
    g = torch.linspace(-1, 2, n).bfloat16() if reduction == "none" else torch.ones((), dtype=torch.bfloat16)
    mode = _LiveBytes(h, w, y, g)
    with mode:
        (linear_cross_entropy(h, w, y, reduction=reduction) * g).sum().backward()
    grads = sum(t.grad.untyped_storage().nbytes() for t in (h, w) if t.grad is not None)
    assert (w.grad is None) == frozen_weight
    want = comp.workspace_bytes(n, d, v, 2, rows, need_dw=not frozen_weight)
    small = 64 + n * (1 + 4 * (reduction == "none"))  # scalars, the ignore mask, "none"'s losses
    assert want <= mode.peak - grads <= want + small, (mode.peak - grads, want)


def test_workspace_of_the_old_default_is_larger():
    """The same call with the fp32 accumulator: V·D·4 bytes where the compensated mode holds the
    bf16 gradient itself (V·D·2) and the plane (V·D/2)."""
    n, d, v = 300, 48, 1001
    peaks = {}
    for mode_name in ("compensated", "fp32"):
        set_linear_ce_options(chunk_rows=64, dw_accum=mode_name)
        h = torch.randn(n, d).bfloat16().requires_grad_()
        w = (0.1 * torch.randn(v, d)).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,))
        mode = _LiveBytes(h, w, y)
        with mode:
            linear_cross_entropy(h, w, y).backward()
        peaks[mode_name] = mode.peak
    assert peaks["fp32"] - peaks["compensated"] >= v * d * 4 - (v * d * 2 + v * ((d + 1) // 2)) - 64


@pytest.mark.parametrize(("n", "d", "v"), [(16384, 768, 32000), (16384, 768, 50304), (16384, 2048, 128256)])
def test_automatic_chunk_fits_twice_liger(n, d, v):
    """At issue 13's shapes the automatic chunk plus the plane and the losses fit twice Liger's
    logits chunk (its whole workspace) and use most of it: the gap is under 16 rows of logits."""
    opts = chunks.LinearCEOptions(dw_accum="compensated")
    rows = chunks.chunk_rows_for(n, d, v, torch.bfloat16, opts, 2, True)
    liger = 2 * comp.liger_chunk_rows(n, d, v) * v * 2
    used = comp.workspace_bytes(n, d, v, 2, rows, True)
    assert rows % 16 == 0 and used <= liger < used + 16 * v * 2, (rows, used, liger)
    frozen = chunks.chunk_rows_for(n, d, v, torch.bfloat16, opts, 2, False)  # no plane: more rows
    assert frozen > rows and comp.workspace_bytes(n, d, v, 2, frozen, False) <= liger


def test_automatic_chunk_below_the_plane_size_takes_16_rows():
    """Where the plane alone (V·D/2 bytes) is as large as twice Liger's chunk (N under about
    V/8, here N = 4096 at V = 50304), the chunk is the documented minimum of 16 rows."""
    opts = chunks.LinearCEOptions(dw_accum="compensated")
    assert chunks.chunk_rows_for(4096, 1024, 50304, torch.bfloat16, opts, 2, True) == 16
    assert chunks.chunk_rows_for(10, 1024, 50304, torch.bfloat16, opts, 2, True) == 10


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET: the kernel as a bf16 launch on a GPU
    specialises it (unit strides are constants there), for the first chunk and a later one."""
    sig = {"g_ptr": "*bf16", "stride_gc": "i32", "h_ptr": "*bf16", "stride_hc": "i32", "hi_ptr": "*bf16",
           "stride_wv": "i32", "lo_ptr": "*u8", "stride_lv": "i32", "n_rows": "i32", "n_vocab": "i32",
           "n_dim": "i32", "half": "i32"}  # fmt: skip
    cfg = comp.DW_LAUNCH["hopper"]
    for first in (True, False):
        consts = {"stride_gv": 1, "stride_hd": 1, "stride_wd": 1, "FIRST": first, "MANT": 7, "EMIN": -126,
                  "BLOCK_V": cfg.block_q, "BLOCK_D": cfg.block_kv, "BLOCK_C": cfg.block_rows, "K_BLOCKS": 8,
                  "NUM_STAGES": cfg.num_stages, "EVEN_VD": True}  # fmt: skip
        ptx = build_sm90(comp._dw_compensated_kernel, sig, consts, cfg.num_warps, cfg.num_stages).asm["ptx"]
        assert "wgmma.mma_async" in ptx, "the chunk GEMM does not use Hopper's tensor-core MMA"
        assert "cp.async" in ptx, "the token loop is not pipelined"


def test_kernel_compiles_for_hopper_with_a_pipelined_loop():
    module = "tests.hydra_kernels.test_linear_ce_compensated"
    proc = run_without_interpreter(f"from {module} import _compile_for_sm90 as c; c(); print('compiled')")
    if proc.returncode and "ptxas" in proc.stderr:
        pytest.skip("this Triton install cannot compile for CUDA offline (no ptxas)")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def _run_script(*args: str):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def test_bench_script_smoke_run(tmp_path):
    """bench_linear_ce.py --smoke (CPU interpreter): the required checks pass, bf16 accumulation
    fails its informational one, every implementation but the unavailable peers is timed, and the
    JSON goes to --out."""
    out = tmp_path / "lce.json"
    result = _run_script(
        "packages/hydra-diag/bench/bench_linear_ce.py", "--smoke", "--json", "--out", str(out)
    )
    assert out.exists() and result["fallbacks"] == 0
    assert all(c["passed"] for c in result["checks"] if c["required"])
    assert [c["passed"] for c in result["checks"] if not c["required"]] == [False]
    timed = {r["impl"] for r in result["timings"] if r.get("ms")}
    assert {"torch eager", "hydra fp32 (old default)", "hydra compensated", "hydra input 2xLiger"} <= timed


def test_precision_emulation_supports_the_four_bits():
    """bench/precision_dw_accum.py at 32 chunks: fp32 and 4 residual bits pass the criterion,
    bf16 accumulation does not (the README's argument, at a size the CPU runs in seconds)."""
    result = _run_script(
        "packages/hydra-diag/bench/precision_dw_accum.py",
        *("--n", "2048", "--d", "32", "--v", "512", "--chunk", "64", "--bits", "4", "--json"),
    )
    line = result["rows"][0]
    assert line["chunks"] == 32 and line["fp32"][0] <= 1 and line["lo4"][0] <= 1 and line["bf16"][0] > 1
