"""generate(): greedy decoding with the cache equals repeated full forwards, in every mode."""

from __future__ import annotations

import pytest
import torch

from hydra_model.generation import sample_next

from .conftest import MODES, random_tokens, small_model


def repeated_forward(model, prompt, steps):
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_generate_equals_repeated_full_forward(mode):
    model = small_model(**MODES[mode]).eval()
    prompt = random_tokens(3, 7)
    got = model.generate(prompt, max_new_tokens=12)
    want = repeated_forward(model, prompt, 12)
    assert got.shape == (3, 19)
    assert torch.equal(got, want)
    assert all(len(set(row[7:].tolist())) >= 3 for row in got)  # a real continuation, not one token


@pytest.mark.parametrize("conv", ["window_gemm", "window_tiles", "headwise"])
@pytest.mark.parametrize("mode", list(MODES))
def test_decode_conv_forms_equal_the_full_forward(mode, conv, monkeypatch):
    """Every form of CCGQA's decode convs (HYDRA_DECODE_CONV: ``window_gemm``, one GEMM over a
    decoded token's window with the q-k mean inside; ``window_tiles``, the default, that GEMM from
    the weight's non-zero tiles; ``headwise``, training's form): each
    decode step's logits equal the full forward's at that position (fp32), and greedy generation
    its tokens."""
    from hydra_model.cache import ModelCache
    from hydra_model.options import OPTIONS

    monkeypatch.setattr(OPTIONS, "decode_conv", conv)
    model = small_model(**MODES[mode]).eval()
    prompt = random_tokens(2, 7)
    got = model.generate(prompt, max_new_tokens=10)
    assert torch.equal(got, repeated_forward(model, prompt, 10))
    cache = ModelCache(capacity=20)
    seq = random_tokens(2, 15, seed=3)
    with torch.no_grad():
        full = model(seq).logits
        model(seq[:, :7], cache=cache)
        for t in range(7, 15):
            step = model(seq[:, t : t + 1], cache=cache).logits[:, -1]
            torch.testing.assert_close(step, full[:, t], rtol=1e-4, atol=1e-4)
    form = "window_tiles" if conv == "window_tiles" else "window"
    windowed = [w for (_, f), (w, _) in cache.conv_bank.weights.items() if f == form]
    if mode == "routing_off" or conv == "headwise":  # no convs (GQA), or no window weight built
        assert not windowed
    elif conv == "window_tiles":  # [C, K·C], K = 3, as its tiles
        assert windowed and all(t.in_features == 3 * t.out_features for t in windowed)
    else:
        assert windowed and all(cols == 3 * rows for rows, cols in (w.shape for w in windowed))  # [C, K·C]


def test_generate_restores_training_mode_and_handles_edge_cases():
    model = small_model().train()
    prompt = random_tokens(1, 1)
    assert torch.equal(model.generate(prompt, 0), prompt)
    out = model.generate(prompt, 3)
    assert model.training and out.shape == (1, 4)
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(torch.zeros(3, dtype=torch.long), 2)


def test_generation_beyond_max_seq_len_grows_the_rotary_table():
    model = small_model(max_seq_len=16).eval()
    out = model.generate(random_tokens(1, 10), 12)
    assert out.shape == (1, 22)


def test_eos_stops_and_pads():
    model = small_model().eval()
    prompt = random_tokens(2, 5)
    free = model.generate(prompt, 6)
    eos = int(free[0, 7])  # the token row 0 emits third
    out = model.generate(prompt, 6, eos_token_id=eos)
    row0 = out[0, 5:].tolist()
    first = row0.index(eos)
    assert all(t == eos for t in row0[first:])


def test_sampling_controls():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(logits, 1.0, top_k=1, generator=g), greedy)
    assert torch.equal(sample_next(logits, 1.0, top_p=1e-6, generator=g), greedy)
    # top-k: never a token outside the k best
    allowed = logits.topk(5, dim=-1).indices
    for _ in range(20):
        s = sample_next(logits, 2.0, top_k=5, generator=g)
        assert all(s[i] in allowed[i] for i in range(4))
    # top-p: the kept set is the smallest prefix of sorted tokens reaching p
    probs = logits.softmax(-1)
    for _ in range(20):
        s = sample_next(logits, 1.0, top_p=0.5, generator=g)
        for i in range(4):
            order = probs[i].argsort(descending=True).tolist()
            cum, keep = 0.0, []
            for t in order:
                keep.append(t)
                cum += probs[i, t].item()
                if cum >= 0.5:
                    break
            assert s[i].item() in keep
    with pytest.raises(ValueError):
        sample_next(logits, -1.0)


def test_seeded_sampling_is_reproducible():
    model = small_model().eval()
    prompt = random_tokens(2, 4)
    a = model.generate(prompt, 8, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 8, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_decode_conv_environment_variable(monkeypatch):
    """HYDRA_DECODE_CONV fills model_options.decode_conv; a bad value names the variable."""
    from hydra_model.options import OPTIONS, reload_env

    try:
        monkeypatch.setenv("HYDRA_DECODE_CONV", "headwise")
        reload_env()
        assert OPTIONS.decode_conv == "headwise"
        monkeypatch.setenv("HYDRA_DECODE_CONV", "fused")
        with pytest.raises(ValueError, match="HYDRA_DECODE_CONV='fused'"):
            reload_env()
    finally:
        monkeypatch.delenv("HYDRA_DECODE_CONV")
        reload_env()
    assert OPTIONS.decode_conv == "window_tiles"  # the default
