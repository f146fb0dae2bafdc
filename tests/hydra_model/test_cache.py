"""Cache primitives: prefill keeps the real prefix, decode writes at the length and advances it
only where the token was routed in."""

from __future__ import annotations

import pytest
import torch

from hydra_model.cache import ModelCache, decode_attend, prefill_kv


def test_prefill_and_masked_decode_steps():
    torch.manual_seed(0)
    cache = ModelCache(capacity=6)
    slot = cache.slot(0, 1)
    assert cache.slot(0, 1) is slot and cache.slot(1, 1) is not slot
    k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    entry = prefill_kv(slot, k, v, torch.tensor([1, 3]))
    assert entry.k.shape == (2, 1, 6, 4) and entry.length.tolist() == [1, 3]
    q = torch.randn(2, 2, 1, 4)
    kn, vn = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    out = decode_attend(entry, q, kn, vn, torch.tensor([False, True]), scale=0.5)
    assert entry.length.tolist() == [1, 4]
    # row 1 attends over its 3 held keys plus the new one, nothing else
    keys = torch.cat([k[1, :, :3], kn[1]], dim=1)  # [1, 4, 4]
    vals = torch.cat([v[1, :, :3], vn[1]], dim=1)
    w = (q[1] @ keys.transpose(-1, -2) * 0.5).softmax(-1)
    torch.testing.assert_close(out[1], w @ vals)
    # row 0 skipped: its next write lands in the same slot and replaces the skipped one
    kn2 = torch.randn(2, 1, 1, 4)
    decode_attend(entry, q, kn2, vn, torch.tensor([True, True]), scale=0.5)
    assert entry.length.tolist() == [2, 5]
    torch.testing.assert_close(entry.k[0, :, 1], kn2[0, :, 0])
    torch.testing.assert_close(entry.k[1, :, 3], kn[1, :, 0])


def test_the_mask_is_kept_in_the_slot_and_opened_one_key_a_step():
    """prefill_kv keeps an additive mask (0 for held keys, −inf beyond); a step opens its own
    position, joining or not, and attends exactly the held keys plus itself (fresh inputs, against
    a softmax written out)."""
    cache = ModelCache(capacity=7)
    k, v = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)
    entry = prefill_kv(cache.slot(0, 0), k, v, torch.tensor([0, 2, 4]))
    inf = float("-inf")
    assert entry.bias.tolist() == [[inf] * 7, [0, 0] + [inf] * 5, [0] * 4 + [inf] * 3]
    held = [[], [0, 1], [0, 1, 2, 3]]
    for write in ([True, False, True], [False, True, True]):
        q, kn, vn = torch.randn(3, 4, 5), torch.randn(3, 2, 5), torch.randn(3, 10)
        pos = entry.length.tolist()
        out = decode_attend(entry, q, kn, vn, torch.tensor(write), scale=0.3)  # [B, Hq, d], flat values
        assert out.shape == (3, 4, 1, 5)
        for b in range(3):
            keys = torch.cat([entry.k[b, :, held[b]], kn[b, :, None]], dim=1)  # [2, n + 1, 5]
            vals = torch.cat([entry.v[b, :, held[b]], vn[b].view(2, 1, 5)], dim=1)
            # query head h reads key/value head h // 2
            keys, vals = keys.repeat_interleave(2, 0), vals.repeat_interleave(2, 0)
            w = (q[b, :, None] @ keys.transpose(-1, -2) * 0.3).softmax(-1)
            torch.testing.assert_close(out[b, :, 0], (w @ vals)[:, 0])
            assert float(entry.bias[b, pos[b]]) == 0.0 and torch.equal(entry.k[b, :, pos[b]], kn[b])
            assert (entry.bias[b, pos[b] + 1 :] == inf).all()
            if write[b]:
                held[b].append(pos[b])
        assert entry.length.tolist() == [p + w for p, w in zip(pos, write, strict=True)]


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("decode", ["eager", "staged"])
def test_a_decode_step_past_the_capacity_raises(arch, decode):
    """A full cache refuses the next decode step (the fused step kernel would drop its key and value
    silently), in the model's forward and in a staged decoder alike."""
    from hydra_model import build_model
    from hydra_model.decode_graphs import StagedDecoder

    torch.manual_seed(0)
    model = build_model(arch, "tiny").eval()
    cache = ModelCache(capacity=6)
    token = torch.tensor([1])
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 5)), cache=cache)
        if decode == "eager":

            def step() -> None:
                model(token.view(1, 1), cache=cache)
        else:
            decoder = StagedDecoder(model, cache, 1, token.device, "staged")

            def step() -> None:
                decoder.step(token)

        step()  # the sixth token fits
        assert cache.seq_len == 6
        with pytest.raises(ValueError, match="no room for 1 more"):
            step()
