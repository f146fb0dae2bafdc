"""cuda_graph.graph_capture: a capture that fails leaves the CUDA random number generator usable."""

import pytest
import torch

from hydra_kernels.cuda_graph import end_generator_capture, graph_capture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _sync_inside_a_capture() -> None:
    x = torch.ones(4, device="cuda")
    x.sum().item()  # a host read: not allowed while the stream is captured


def _draw() -> torch.Tensor:
    return torch.rand(64, device="cuda") + torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)


def test_a_failed_capture_leaves_random_numbers_as_they_were():
    seed = torch.seed() % 2**31
    torch.cuda.manual_seed(seed)
    expected = _draw()
    torch.cuda.manual_seed(seed)
    caller = torch.cuda.current_stream()
    with pytest.raises(RuntimeError), graph_capture(torch.cuda.CUDAGraph()):
        _sync_inside_a_capture()
    assert torch.cuda.current_stream() == caller  # not left on the capture stream
    assert not torch.cuda.is_current_stream_capturing()
    torch.testing.assert_close(_draw(), expected, rtol=0, atol=0)  # the stream goes on unchanged


def test_torchs_own_capture_breaks_the_generator_which_the_repair_undoes():
    """What graph_capture works around, checked against the torch that runs: after a failed plain
    ``torch.cuda.graph`` capture the thread is left on the capture stream, and random ops on the
    device fail until a clean capture ends. When a torch no longer does this, the assertions
    fail and graph_capture can go."""
    caller = torch.cuda.current_stream()
    with pytest.raises(RuntimeError), torch.cuda.graph(torch.cuda.CUDAGraph()):
        _sync_inside_a_capture()
    try:
        assert torch.cuda.current_stream() != caller
        with pytest.raises(RuntimeError, match="capture"):
            _draw()
    finally:
        torch.cuda.set_stream(caller)
        end_generator_capture()
    torch.cuda.manual_seed(3)
    first = _draw()
    torch.cuda.manual_seed(3)
    torch.testing.assert_close(_draw(), first, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_failed_capture_on_another_device_restores_both_devices_streams():
    torch.cuda.set_device(0)
    caller, other = torch.cuda.current_stream(0), torch.cuda.current_stream(1)
    with pytest.raises(RuntimeError), graph_capture(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream(1)):
        torch.ones(4, device="cuda:1").sum().item()
    assert torch.cuda.current_device() == 0
    assert torch.cuda.current_stream(0) == caller and torch.cuda.current_stream(1) == other
    with torch.cuda.device(1):  # the capture device's generator is out of capture mode
        assert _draw().isfinite().all()
