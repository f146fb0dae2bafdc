"""Suite-wide setup. TRITON_INTERPRET must be set before anything imports triton, so that the
Triton kernels themselves run (interpreted) on CPU tensors when there is no GPU."""

import os
import tempfile

try:  # probing CUDA without importing torch first would be nicer, but torch is cheap enough here
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hugging Face interop tests (export/import, patch): never touch the network, and keep the
# remote-code modules transformers copies out of the user's cache. Read when transformers is
# imported, so set before any test module imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_MODULES_CACHE", os.path.join(tempfile.gettempdir(), "hydra-tests-hf-modules"))


import pytest


@pytest.fixture(autouse=True)
def _own_pretest_records(tmp_path, monkeypatch):
    """hydra-train run shares pretest verdicts through $HYDRA_CACHE_DIR/pretests: each test gets its
    own folder, so no test reuses another's verdicts (or the user's)."""
    try:
        from hydra_train.safe_opts import pretest_log
    except ImportError:  # pragma: no cover - hydra-train not installed
        return
    monkeypatch.setattr(pretest_log, "shared_pretest_dir", lambda: tmp_path / "machine-pretests")


@pytest.fixture(autouse=True)
def _restore_kernel_switches(request):
    """hydra_kernels' switches (the Triton path, Liger's CE, each op's) are put back after each
    test as it found them: a test that turns them off, as hydra-train's SafeOptimizations toggles
    do, does not decide which path the tests after it run. A module- or session-scoped fixture's
    changes are not undone here (it runs before this fixture's snapshot). A test that leaves a
    kernel fallback counted fails unless marked ``fallback_expected``: a kernel that failed at
    run time and ran its PyTorch reference would otherwise pass unseen."""
    try:
        from hydra_kernels import controls
        from hydra_kernels.options import OPTIONS
    except ImportError:  # pragma: no cover - hydra-kernels not installed
        yield
        return
    ops = {op: (sw.forward, sw.backward) for op, sw in OPTIONS.ops.items()}
    triton, liger_ce = OPTIONS.triton, OPTIONS.liger_ce
    controls.reset_fallback_counts()
    yield
    OPTIONS.triton, OPTIONS.liger_ce = triton, liger_ce
    for op, (forward, backward) in ops.items():
        if op in OPTIONS.ops:
            OPTIONS.ops[op].forward, OPTIONS.ops[op].backward = forward, backward
    fell_back = {op: n for op, n in controls.fallback_counts().items() if n}
    controls.reset_fallback_counts()
    if fell_back and request.node.get_closest_marker("fallback_expected") is None:
        pytest.fail(f"kernel fallbacks counted: {fell_back}; mark the test fallback_expected if meant")


@pytest.fixture
def nine_hours_east(monkeypatch):
    """Local time 9 hours ahead of UTC (POSIX TZ string: no tz database needed), so that local and
    UTC stamps differ, as on most machines (the metrics database's and pretest logs' times)."""
    import time

    if not hasattr(time, "tzset"):
        pytest.skip("time.tzset is POSIX only")
    monkeypatch.setenv("TZ", "JST-9")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()
