"""The dense GPT baseline: preset sizes against HYDRA's, the forward against an independent fp64
implementation of Llama's maths, causality, cached decoding, compile, the Triton paths.
Persistence, build_model and the CLI: test_gpt_persistence.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hydra_model import (
    GPT_PRESETS,
    MODEL_PRESETS,
    GPTConfig,
    GPTModel,
    ModelCache,
    build_model,
    create_ccgqa_mod_mor_model,
    gpt_config,
)

from .test_ccgqa import HKV as CC_HKV
from .test_ccgqa import HQ as CC_HQ
from .test_ccgqa import D as CC_D
from .test_ccgqa import E as CC_E
from .test_ccgqa import reference as ccgqa_reference

#: odd widths: q width 6·8 = 48 ≠ dim 36, GQA groups of 3, vocab not a power of two
GQA_SHAPES = dict(vocab_size=53, dim=36, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8, mlp_hidden=64)
#: test_ccgqa's reference is written for its widths
CCGQA_SHAPES = dict(
    vocab_size=53, dim=CC_E, n_layers=2, n_heads=CC_HQ, n_kv_heads=CC_HKV, head_dim=CC_D, mlp_hidden=64
)
SHAPES = {"gqa": GQA_SHAPES, "ccgqa": CCGQA_SHAPES}


def random_model(attention: str, seed: int = 0, **overrides) -> GPTModel:
    """Weights far from the init (norm gains ≠ 1, CCGQA conv biases and temperatures ≠ 0), so a
    reference that skipped any of them would disagree."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**SHAPES[attention], "max_seq_len": 32, "attention": attention, **overrides})
    model = GPTModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() >= 2 and "conv" not in name:
                p.normal_(std=1 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(std=0.3)
    return model


def tokens(batch: int, seq: int, vocab: int = 53, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


# --- the independent fp64 reference --------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rotate_half_rope(t: torch.Tensor, base: float) -> torch.Tensor:
    """Llama (HF) RoPE: t [B, S, H, d]; x·cos + rotate_half(x)·sin over the whole head."""
    d = t.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t.shape[1], dtype=torch.float64)[:, None] * inv[None]  # [S, d/2]
    emb = torch.cat([ang, ang], -1)[None, :, None, :]
    rotated = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
    return t * emb.cos() + rotated * emb.sin()


def _gqa_reference(layer, x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    b, s, _ = x.shape
    d, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    w = layer.attn.w_qkv.weight.double()
    q = (x @ w[: hq * d].t()).view(b, s, hq, d)
    k = (x @ w[hq * d : (hq + hkv) * d].t()).view(b, s, hkv, d)
    v = (x @ w[(hq + hkv) * d :].t()).view(b, s, hkv, d)
    q, k = _rotate_half_rope(q, cfg.rope_base), _rotate_half_rope(k, cfg.rope_base)
    k = k.repeat_interleave(hq // hkv, dim=2)  # Llama's repeat_kv: head h reads kv head h // G
    v = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).reshape(b, s, hq * d)
    return out @ layer.attn.w_o.weight.double().t()


def reference_logits(model: GPTModel, ids: torch.Tensor) -> torch.Tensor:
    """The whole decoder written out in fp64 from the parameters."""
    cfg = model.config
    emb = model.embed.weight.double()
    h = emb[ids]
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    for layer in model.layers:
        x = _rms(h, layer.attn_norm.weight.double(), cfg.norm_eps)
        if cfg.attention == "gqa":
            h = h + _gqa_reference(layer, x, cfg)
        else:
            h = h + ccgqa_reference(layer.attn, x, pos, base=cfg.rope_base)
        x = _rms(h, layer.mlp_norm.weight.double(), cfg.norm_eps)
        gate_up = x @ layer.mlp.w_gate_up.weight.double().t()
        gate, up = gate_up[..., : cfg.mlp_hidden], gate_up[..., cfg.mlp_hidden :]
        h = h + (F.silu(gate) * up) @ layer.mlp.w_down.weight.double().t()
    return _rms(h, model.norm.weight.double(), cfg.norm_eps) @ emb.t()


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", list(MODEL_PRESETS))
def test_preset_parameter_count_is_within_ten_percent_of_hydra(size):
    assert set(GPT_PRESETS) == set(MODEL_PRESETS)
    with torch.device("meta"):
        gpt = build_model("gpt", size, vocab_size=32000)
        hydra = create_ccgqa_mod_mor_model(size, vocab_size=32000)
    ratio = gpt.num_parameters() / hydra.num_parameters()
    assert 0.9 <= ratio <= 1.1, (size, gpt.num_parameters(), hydra.num_parameters())
    cfg = gpt.config
    assert cfg.mlp_hidden % 64 == 0 and cfg.head_dim == 64 and cfg.n_heads % cfg.n_kv_heads == 0
    # the count is the closed form of the architecture (tied head counted once)
    e, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = e * (q + 2 * kv) + q * e + 3 * e * cfg.mlp_hidden + 2 * e
    assert gpt.num_parameters() == 32000 * e + cfg.n_layers * per_layer + e


def test_100m_is_the_classic_12_by_768():
    cfg = gpt_config("100M")
    assert (cfg.n_layers, cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads) == (12, 768, 64, 12, 4)


@pytest.mark.parametrize("attention", ["gqa", "ccgqa"])
def test_forward_matches_independent_fp64_reference(attention):
    model = random_model(attention).double().eval()
    ids = tokens(2, 13)
    out = model(ids).logits
    ref = reference_logits(model, ids)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # and the loss is the cross-entropy of those logits
    targets = tokens(2, 13, seed=5)
    targets[0, :3] = -100
    loss = model(ids, targets).loss  # computed in fp32, as for every dtype
    want = F.cross_entropy(ref.reshape(-1, 53), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["gqa", "ccgqa"])
def test_causal_perturbing_later_tokens_leaves_earlier_logits(attention):
    model = random_model(attention).eval()
    ids = tokens(2, 17)
    t = 9
    changed = ids.clone()
    changed[:, t + 1 :] = tokens(2, 17 - t - 1, seed=7)
    assert not torch.equal(changed, ids)
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("attention", ["gqa", "ccgqa"])
def test_incremental_decoding_equals_full_forward(attention):
    model = random_model(attention).eval()
    ids = tokens(3, 14)
    with torch.no_grad():
        full = model(ids).logits
        cache = ModelCache(capacity=14)
        steps = [model(ids[:, :5], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    # generate() is greedy decoding through that cache: each new token is the argmax of the
    # full forward over everything before it
    out = model.generate(ids[:, :4], 6)
    assert out.shape == (3, 10) and torch.equal(out[:, :4], ids[:, :4])
    with torch.no_grad():
        torch.testing.assert_close(model(out[:, :-1]).logits[:, 3:].argmax(-1), out[:, 4:], atol=0, rtol=0)


def test_compiles_fullgraph_and_matches_eager():
    model = random_model("gqa").train()
    ids, targets = tokens(2, 12), tokens(2, 12, seed=3)
    eager = model(ids, targets)
    eager.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(ids, targets)
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss)
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5, msg=n)


def test_chunked_ce_gives_the_same_loss_and_gradients_without_logits():
    plain = random_model("gqa")
    chunked = random_model("gqa", use_chunked_ce=True)
    ids, targets = tokens(2, 11), tokens(2, 11, seed=4)
    a, b = plain(ids, targets), chunked(ids, targets)
    assert b.logits is None
    torch.testing.assert_close(b.loss, a.loss, atol=1e-5, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(chunked.embed.weight.grad, plain.embed.weight.grad, atol=1e-5, rtol=1e-4)


def test_init_scales_residual_projections_and_loss_starts_near_log_vocab():
    torch.manual_seed(0)
    model = GPTModel(
        GPTConfig(
            vocab_size=300,
            dim=64,
            n_layers=8,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            mlp_hidden=128,
            init_std=0.02,
        )
    )
    resid = 0.02 / math.sqrt(2 * 8)
    assert model.layers[3].attn.w_o.weight.std().item() == pytest.approx(resid, rel=0.1)
    assert model.layers[3].mlp.w_down.weight.std().item() == pytest.approx(resid, rel=0.1)
    assert model.layers[3].attn.w_qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    loss = model(tokens(4, 32, vocab=300), tokens(4, 32, vocab=300, seed=2)).loss
    assert abs(loss.item() - math.log(300)) < 0.1


def test_routing_free_contract():
    model = random_model("gqa")
    assert model.routing_stats() == {"mod": [], "mor": [], "moe": []}
    assert model.moe_layers() == []
    out = model(tokens(1, 5), tokens(1, 5, seed=2))
    assert out.aux_losses == {} and out.ce_loss is out.loss
    cfg = model.config
    # analytic FLOPs: 3 × (per layer: projections, causal attention, SwiGLU; LM head)
    t = 20
    e, q, kv = cfg.dim, cfg.q_dim, cfg.kv_dim
    layer = 2 * e * (q + 2 * kv) + 2 * q * e + 4 * q * (t + 1) / 2 + 6 * e * cfg.mlp_hidden
    expected = 3 * (cfg.n_layers * layer + 2 * e * cfg.vocab_size)
    assert model.flops_per_token(t) == pytest.approx(expected)
    assert model.flops_per_token(t, executed=False) == model.flops_per_token(t)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"mlp_hidden": 100}, "mlp_hidden=100 must be a multiple of 64; use 128"),
        ({"n_heads": 6, "n_kv_heads": 4}, "n_heads=6 must be a multiple of n_kv_heads=4"),
        ({"head_dim": 7}, "head_dim=7 must be even"),
        ({"attention": "mla"}, "attention='mla'; expected one of gqa, ccgqa"),
        ({"n_layers": 0}, "n_layers=0 must be a positive integer"),
        ({"norm_eps": 0.0}, "norm_eps=0.0 must be positive"),
    ],
)
def test_config_validation_names_the_field_and_the_fix(override, message):
    with pytest.raises(ValueError, match=f"GPTConfig: {message}".replace("(", r"\(").replace(")", r"\)")):
        gpt_config("tiny", **override)


def test_config_dict_round_trip():
    cfg = gpt_config("debug", attention="ccgqa", use_chunked_ce=True)
    assert GPTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.diff(cfg.replace(n_layers=3)) == ["n_layers: 6 != 3"]


def test_triton_kernels_under_the_interpreter_match_the_references():
    """One tiny forward+backward with the hydra_kernels Triton paths on (rms_norm, the fused
    residual add + norm, RoPE, SwiGLU, linear cross-entropy), interpreted on the CPU."""
    import hydra_kernels

    torch.manual_seed(0)
    model = GPTModel(
        GPTConfig(
            vocab_size=37,
            dim=32,
            n_layers=2,
            n_heads=2,
            n_kv_heads=1,
            head_dim=16,
            mlp_hidden=64,
            max_seq_len=16,
            use_chunked_ce=True,
        )
    ).train()
    ids, targets = tokens(1, 6, vocab=37), tokens(1, 6, vocab=37, seed=3)
    runs = {}
    for use_triton in (False, True):
        hydra_kernels.set_use_triton_kernels(use_triton)
        hydra_kernels.reset_fallback_counts()
        model.zero_grad()
        out = model(ids, targets)
        out.loss.backward()
        runs[use_triton] = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if use_triton:
            assert sum(hydra_kernels.fallback_counts().values()) == 0, hydra_kernels.fallback_counts()
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-4, rtol=1e-4)
    for n, g in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][n], g, atol=1e-4, rtol=1e-3, msg=n)


def test_numpy_integers_become_ints_so_the_config_stays_json():
    import numpy as np

    cfg = gpt_config("tiny", vocab_size=np.int64(300), n_layers=np.int32(2))
    assert type(cfg.vocab_size) is int and type(cfg.n_layers) is int
    assert json.loads(json.dumps(cfg.to_dict()))["vocab_size"] == 300
    with pytest.raises(ValueError, match="n_layers=True must be a positive integer"):
        gpt_config("tiny", n_layers=True)
