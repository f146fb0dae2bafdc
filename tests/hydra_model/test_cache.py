"""Cache primitives: prefill keeps the real prefix, decode writes at the length and advances it
only where the token was routed in."""

from __future__ import annotations

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
