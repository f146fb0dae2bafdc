"""conditional_graphs.py: the probe that decides whether a decode step may skip routed blocks under
conditional CUDA graph nodes says why not where it cannot, and (on a GPU whose torch has them)
checks that an IF body runs with the flag set and only then."""

import pytest
import torch

from hydra_model.conditional_graphs import conditional_nodes_fail, has_conditional_nodes


def test_the_probe_refuses_a_device_without_cuda_graphs():
    assert "need a CUDA device" in conditional_nodes_fail(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_probe_on_cuda():
    failed = conditional_nodes_fail(torch.device("cuda", torch.cuda.current_device()))
    if has_conditional_nodes():
        assert failed is None, failed  # the body ran with the flag set and was skipped without it
    else:
        assert failed == f"torch {torch.__version__} has no conditional CUDA graph nodes"


def test_driver_structs_have_the_cuda_12_4_layout():
    """The ctypes mirrors of the driver's node parameters, against the header's layout worked out
    by hand: CUgraphNodeParams is an int, 3 reserved ints, a 232-byte union (29 long longs) and a
    long long; the kernel parameters pack a pointer, seven unsigned ints (padded to 40) and four
    pointers; the conditional ones a handle, two 32-bit fields and two pointers."""
    import ctypes

    from hydra_model.graph_compose import ConditionalNodeParams, GraphNodeParams, KernelNodeParams

    assert ctypes.sizeof(GraphNodeParams) == 4 + 12 + 29 * 8 + 8
    assert GraphNodeParams.u.offset == 16 and GraphNodeParams.reserved2.offset == 248

    def offsets(struct, *names):
        return [getattr(struct, name).offset for name in names]

    assert offsets(KernelNodeParams, "func", "gridDimX", "sharedMemBytes", "kernelParams") == [0, 8, 32, 40]
    assert offsets(KernelNodeParams, "extra", "kern", "ctx") == [48, 56, 64]
    names = ("handle", "type", "size", "phGraph_out", "ctx")
    assert offsets(ConditionalNodeParams, *names) == [0, 8, 12, 16, 24]


def test_the_composed_probe_refuses_a_device_without_cuda_graphs():
    from hydra_model.graph_compose import driver_conditional_fail

    assert "need a CUDA device" in driver_conditional_fail(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_composed_probe_on_cuda():
    """On a GPU with a CUDA 12.4+ driver the driver-built IF node runs its body with the flag set
    and only then (the probe compares both replays with eager results)."""
    from hydra_model.graph_compose import driver_conditional_fail

    assert driver_conditional_fail(torch.device("cuda", torch.cuda.current_device())) is None
