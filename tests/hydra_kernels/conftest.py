"""Shared fixtures and helpers of the hydra-kernels tests: every test starts and ends with the
default switches, no fallbacks counted and no launch overrides; ``seed`` draws a fresh seed per
test; the kernel test modules share their device, their skip mark and the sm_90 compile check."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.launch_config import clear_launch_overrides

#: Where the kernel tests run: the GPU when there is one, else the CPU (Triton interpreted).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: ``pytestmark`` of the modules whose every test launches a Triton kernel.
NEEDS_TRITON = pytest.mark.skipif(
    not controls.device_supports_triton(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="needs the Triton interpreter (TRITON_INTERPRET=1) or CUDA",
)


def _reset(counts: bool = True) -> None:
    controls.set_use_triton_kernels(True)
    controls.reload_env()
    if counts:
        controls.reset_fallback_counts()
    clear_launch_overrides()


@pytest.fixture(autouse=True)
def _default_kernel_controls():
    """Default switches around each test. The fallbacks a test leaves counted are checked after it
    by the suite's fixture (tests/conftest.py), so they are not cleared here."""
    _reset()
    yield
    _reset(counts=False)


@pytest.fixture
def seed() -> int:
    """A fresh random seed (not a fixed one that could hide a bug); tests print it on failure."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def build_sm90(fn, signature, constexprs, num_warps, num_stages):
    """Compile a Triton kernel for sm_90 (PTX and cubin through the bundled ptxas): no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    # Pointers and row strides divisible by 16, as Triton specialises them at launch for these widths.
    aligned = {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]]
        for a, t in signature.items()
        if t[0] == "*" or a.startswith("stride")
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def run_without_interpreter(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root without TRITON_INTERPRET: the interpreter skips
    Triton's compiler, so GPU code generation can only be checked in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )


def assert_compiles_for_sm90(test_file: str) -> None:
    """Run ``_compile_for_sm90()`` of the test module at ``test_file`` without the interpreter and
    require it to succeed."""
    module = f"tests.hydra_kernels.{Path(test_file).stem}"
    proc = run_without_interpreter(f"from {module} import _compile_for_sm90 as c; c(); print('compiled')")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def sm90_access_counts(code: str) -> dict[str, tuple[int, ...]]:
    """Run ``code`` (which compiles kernels for sm_90 and prints ``NAME N1 N2 ...`` lines) without
    the interpreter; NAME → the numbers. Skips when this Triton cannot compile for CUDA offline."""
    proc = run_without_interpreter(code)
    if proc.returncode and "ptxas" in proc.stderr:
        pytest.skip("this Triton install cannot compile for CUDA offline (no ptxas)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.split()[0]: tuple(map(int, line.split()[1:])) for line in proc.stdout.splitlines()}
