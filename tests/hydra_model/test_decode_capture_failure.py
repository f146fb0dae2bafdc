"""Decoding after its CUDA-graph captures fail: the fallback runs, says why, and can still sample."""

import pytest
import torch

from .test_decode_graphs import routed_model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_sampling_goes_on_eagerly_when_every_capture_fails(monkeypatch):
    """A decoder whose captures all fail (a host read inside each, injected) decodes with eager
    stages, reports why, and still samples from torch's default CUDA generator: a failed capture
    once left that generator unusable, and the fallback then failed on its first random draw."""
    from hydra_model import decode_graphs

    run_stages = decode_graphs._Segment.run_stages

    def read_while_captured(seg) -> None:
        if torch.cuda.is_current_stream_capturing():
            torch.ones(1, device="cuda").item()
        run_stages(seg)

    monkeypatch.setattr(decode_graphs._Segment, "run_stages", read_while_captured)
    model = routed_model(seed=torch.seed() % 2**31).cuda()
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), device="cuda")
    with pytest.warns(UserWarning, match="decoding without CUDA graphs"):
        out = model.generate(prompt, 12, temperature=1.0, decode="graphs", keep_decoder=False)
    report = model.last_decode_report
    assert report.capture is None and report.mode == "staged" and "capture failed" in report.reason
    assert out.shape == (2, 18) and torch.equal(out[:, :6], prompt)
    assert torch.rand(8, device="cuda").isfinite().all()
