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
