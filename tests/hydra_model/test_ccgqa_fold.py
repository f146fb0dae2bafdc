"""ccgqa_fold: CCGQA's conv weights built for many modules at once equal each module's own build,
and a generation builds each form once, for every CCGQA module of the model together."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import hydra_model.ccgqa as ccgqa_mod
import hydra_model.ccgqa_fold as ccgqa_fold
import hydra_model.model as model_mod
from hydra_kernels import controls
from hydra_kernels.launch_count import KernelCount
from hydra_kernels.ops.tile_linear import pack_tiles_many, tile_linear_ref
from hydra_model import CCGQAAttention
from hydra_model.cache import ConvBank, ModelCache
from hydra_model.ccgqa_fold import FOLD_FORMS, fold_into_bank, fold_many

from .conftest import random_tokens, small_model


def random_modules(count: int, seed: int, dtype=torch.float32) -> list[CCGQAAttention]:
    """CCGQA modules (4 query heads of 16, 2 kv heads: 64-wide tiles of the window weight) with
    every conv parameter fresh random (a zero would hide a mixed-up index)."""
    torch.manual_seed(seed)
    mods = [CCGQAAttention(64, 4, 2, 16, 8).to(dtype) for _ in range(count)]
    with torch.no_grad():
        for m in mods:
            for p in (m.conv_seq.weight, m.conv_seq.bias, m.conv_ch.weight, m.conv_ch.bias):
                p.normal_()
    return mods


def spy_fold_many(monkeypatch, record) -> list:
    """Record ``record(group, form)`` for each call of ccgqa_fold.fold_many."""
    calls, real = [], ccgqa_fold.fold_many

    def spy(group, form):
        calls.append(record(group, form))
        return real(group, form)

    monkeypatch.setattr(ccgqa_fold, "fold_many", spy)
    return calls


@pytest.mark.parametrize("form", FOLD_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folding_many_equals_folding_each_alone(form, dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    mods = random_modules(3, seed, dtype)
    together = fold_many(mods, form)
    for m, (weight, bias) in zip(mods, together, strict=True):
        own_weight, own_bias = fold_many([m], form)[0]
        if form == "window_tiles":
            assert torch.equal(weight.index, own_weight.index), f"seed {seed}"  # one pattern: the heads'
            weight, own_weight = weight.tiles, own_weight.tiles
        assert torch.equal(weight, own_weight), f"seed {seed}"  # elementwise: bitwise the same
        torch.testing.assert_close(bias, own_bias, msg=f"seed {seed}")


def test_the_batched_builders_equal_a_loop_over_the_leading_dimension():
    seed = int.from_bytes(os.urandom(4), "little")
    mods = random_modules(2, seed, torch.float64)
    stacked = [torch.stack([m.get_parameter(n) for m in mods]) for n in
               ("conv_seq.weight", "conv_seq.bias", "conv_ch.weight", "conv_ch.bias")]  # fmt: skip
    mix = torch.stack([m.qk_mean_mix.double() for m in mods])
    for build, extra in ((ccgqa_fold.headwise_qk_weight, ()), (ccgqa_fold.folded_qk_weight, (mix,))):
        weights, biases = build(*stacked, *extra)
        for i in range(2):
            w, b = build(*(t[i] for t in stacked), *(e[i] for e in extra))
            torch.testing.assert_close(weights[i], w, rtol=0, atol=1e-12, msg=f"seed {seed}")
            torch.testing.assert_close(biases[i], b, rtol=0, atol=1e-12, msg=f"seed {seed}")


INTERPRETED = controls.device_supports_triton(torch.device("cpu"))  # launches are counted interpreted


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiles_kernel_builds_the_op_by_op_tiles_in_one_launch(dtype):
    """Without gradients the window tiles of all modules come from one kernel launch once the
    shape's layout is known (hydra_kernels' ccgqa_window_tiles, no fallback), with the same tile
    index, and at least as close to the fp64 fold as the op-by-op build (whose products and
    partial sums are rounded one by one), weights and biases."""
    seed = int.from_bytes(os.urandom(4), "little")
    mods = random_modules(3, seed, dtype)
    exact = fold_many([copy.deepcopy(m).double() for m in mods], "window")
    falls = controls.fallback_counts().get("ccgqa_window_tiles", 0)
    with torch.no_grad():
        op_by_op = fold_many(mods, "window_tiles")  # the model tests' default: the references
        controls.set_use_triton_kernels(True)
        try:
            fold_many(mods, "window_tiles")  # the shape's layout, made once and kept
            with KernelCount() as launched:
                kernel = fold_many(mods, "window_tiles")
        finally:
            controls.set_use_triton_kernels(False)
    assert dict(launched.kernels) == {"triton:_window_tiles_kernel": 1}, f"seed {seed}"
    assert controls.fallback_counts().get("ccgqa_window_tiles", 0) == falls
    for (tiled, bias), (ref_tiled, ref_bias), (w, b) in zip(kernel, op_by_op, exact, strict=True):
        assert torch.equal(tiled.index, ref_tiled.index) and tiled.tiles.dtype == dtype
        layout = ccgqa_fold.window_tile_layout(mods[0], torch.device("cpu"))
        dense = pack_tiles_many(w.unsqueeze(0), *ccgqa_fold.WINDOW_TILE, layout)[0].tiles
        err = (tiled.tiles.double() - dense).abs().max()
        ref_err = (ref_tiled.tiles.double() - dense).abs().max()
        assert err <= ref_err + 1e-12, f"seed {seed}: {err} against the op-by-op {ref_err}"
        err, ref_err = (bias.double() - b).abs().max(), (ref_bias.double() - b).abs().max()
        assert err <= max(ref_err, b.abs().max() * 2**-8), f"seed {seed}: bias {err} against {ref_err}"


def test_a_bank_builds_a_form_for_all_its_same_shaped_modules_at_the_first_request(monkeypatch):
    mods = random_modules(3, 0)
    odd = CCGQAAttention(32, 2, 1, 16, 8)  # another shape: built in a group of its own
    calls = spy_fold_many(monkeypatch, lambda group, form: len(group))
    bank = ConvBank(modules=[*mods, odd])
    with torch.no_grad():
        fold_into_bank(bank, mods[1], "window_tiles")
        assert calls == [3] and all((m, "window_tiles") in bank.weights for m in mods)
        assert (odd, "window_tiles") not in bank.weights
        fold_into_bank(bank, odd, "window_tiles")
        fold_into_bank(bank, mods[0], "headwise")
    assert calls == [3, 1, 3]


@pytest.mark.parametrize("mode", ["dynamic", "routing_off", "long_prompt"])
def test_a_generation_builds_each_form_once_for_the_whole_model(mode, monkeypatch):
    """The decode steps' tiles (which a short prompt's prefill uses too) and, for a prompt past
    PREFILL_WINDOW_ROWS, the prefill's head-wise weight: one batched build each for the model's
    CCGQA modules (three blocks × three recursions share three modules), none for a model
    without CCGQA; a restarted cache builds nothing again."""
    if mode == "long_prompt":
        monkeypatch.setattr(ccgqa_mod, "PREFILL_WINDOW_ROWS", 0)
    overrides = {"routing_off": True} if mode == "routing_off" else {}
    model = small_model(**overrides).eval()
    calls = spy_fold_many(monkeypatch, lambda group, form: (len(group), form))
    prompt = random_tokens(2, 7)
    cache = ModelCache(capacity=16)
    with torch.no_grad():
        model(prompt, cache=cache)
        for t in range(3):
            model(prompt[:, t : t + 1], cache=cache)
        n_ccgqa = sum(isinstance(m, CCGQAAttention) for m in model.modules())
        if mode == "routing_off":
            assert n_ccgqa == 0 and calls == []
            return
        short = ["window_tiles", "joint_temperature"]  # the decode steps' tiles, the prefill's temperatures
        forms = ["window_tiles", "headwise"] if mode == "long_prompt" else short
        assert calls == [(n_ccgqa, form) for form in forms]
        cache.restart()
        model(prompt, cache=cache)
        model(prompt[:, :1], cache=cache)
    assert len(calls) == len(forms)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_forward_without_a_cache_folds_every_blocks_convs_at_once(checkpoint, monkeypatch):
    """Training and evaluation forwards hand each block its conv weights from one batched build
    (three blocks × three recursions: one fold, not nine); loss and every gradient equal those of
    the forward where each module folds its own (fold_blocks answering None), fresh random
    inputs, with and without gradient checkpointing; the evaluation forward too."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    model = small_model().train()
    model.threshold_commit = "manual"  # the same thresholds for both forwards
    if checkpoint:
        model.enable_gradient_checkpointing(every=1)
    x, y = random_tokens(2, 13, seed=seed % 1000), random_tokens(2, 13, seed=seed % 1000 + 1)
    folds = []
    real = ccgqa_fold._head_blocks
    monkeypatch.setattr(ccgqa_fold, "_head_blocks", lambda *a: folds.append(a[0].shape) or real(*a))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(x, targets=y)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            logits = model.eval()(x).logits
        model.train()
        return out.loss.detach(), grads, logits

    together = loss_and_grads()
    assert len(folds) == 2 and folds[0][0] == 3, (seed, folds)  # [3 modules, ...], outside any checkpoint
    monkeypatch.setattr(model_mod, "fold_blocks", lambda attns: None)
    folds.clear()
    alone = loss_and_grads()
    assert len(folds) == 9 * (2 + checkpoint), (seed, len(folds))  # each module, each recursion
    torch.testing.assert_close(together[0], alone[0], rtol=1e-6, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(together[2], alone[2], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    assert together[1].keys() == alone[1].keys()
    for name, grad in together[1].items():
        torch.testing.assert_close(grad, alone[1][name], rtol=1e-5, atol=1e-6, msg=f"seed {seed}: {name}")


def test_folding_every_block_at_once_stands_aside_for_gqa_and_sharded_parameters():
    """fold_blocks answers None (each module then folds its own) for a model whose blocks' attention
    is plain GQA and where a conv parameter is not a plain tensor (FSDP2's sharded DTensors until
    the block runs); otherwise one (weight, bias) per block."""
    assert (
        ccgqa_fold.fold_blocks([blk.mor.block.attn for blk in small_model(routing_off=True).blocks]) is None
    )
    attns = [blk.mor.block.attn for blk in small_model().blocks]
    built = ccgqa_fold.fold_blocks(attns)
    assert len(built) == len(attns) and all(w.shape[0] == m.n_heads + m.n_kv_heads for (w, _), m in
                                            zip(built, attns, strict=True))  # fmt: skip

    class Sharded(torch.nn.Parameter):
        pass

    attns[1].conv_ch.weight = Sharded(attns[1].conv_ch.weight.detach().clone())
    assert ccgqa_fold.fold_blocks(attns) is None


@pytest.mark.parametrize(
    ("dim", "heads", "kv_heads", "head_dim", "k_seq", "k_ch"),
    [(64, 4, 2, 16, 2, 2), (96, 6, 2, 16, 3, 2), (768, 12, 4, 64, 2, 2)],  # the last: the 100M preset's
)
def test_the_window_tile_layout_keeps_every_tile_a_fold_can_fill(dim, heads, kv_heads, head_dim, k_seq, k_ch):
    """The layout known from the shapes (no host read) holds every tile that is non-zero in folds of
    fresh random conv weights, and no more at the 100M shape; the tiles packed with it give the dense
    window product (fp64)."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    mods = [CCGQAAttention(dim, heads, kv_heads, head_dim, 8, k_seq, k_ch) for _ in range(2)]
    with torch.no_grad():
        for m in mods:
            for p in (m.conv_seq.weight, m.conv_seq.bias, m.conv_ch.weight, m.conv_ch.bias):
                p.normal_()
        dense = torch.stack([w for w, _ in fold_many(mods, "window")])  # [L, C, K·C]
        layout = ccgqa_fold.window_tile_layout(mods[0], torch.device("cpu"))
        by_value = pack_tiles_many(dense, *ccgqa_fold.WINDOW_TILE)[0].index
        kept = {(r, int(c)) for r, row in enumerate(layout.index) for c in row if c >= 0}
        filled = {(r, int(c)) for r, row in enumerate(by_value) for c in row if c >= 0}
        assert filled <= kept, f"seed {seed}: tiles {sorted(filled - kept)} left out"
        if dim == 768:  # 6% of the tiles: none kept in vain
            assert kept == filled, f"seed {seed}: {len(kept)} tiles kept, {len(filled)} filled"
            assert len(kept) < 0.1 * (dense.shape[1] // 64) * (dense.shape[2] // 64)
        packed = fold_many(mods, "window_tiles")
        x = torch.randn(3, dense.shape[-1])
        for (tiled, bias), w in zip(packed, dense, strict=True):
            want = x.double() @ w.double().T + bias.double()
            got = tile_linear_ref(x, tiled, bias)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=f"seed {seed}")


def _dense_folded_weight(seq_weight, ch_weight, mean_mix):
    """The folded weight built densely: the grouped conv as a block-diagonal [C, C, k_ch] (an
    identity over heads times each head's taps), times the depthwise taps, summed per window
    offset, plus the q-k mean on the newest offset (how ccgqa_fold built it before it computed
    the diagonal blocks alone)."""
    *lead, c, d, k_ch = ch_weight.shape
    k_seq = seq_weight.shape[-1]
    heads, k_total = c // d, k_seq + k_ch - 1
    eye = torch.eye(heads, dtype=ch_weight.dtype).view(heads, 1, heads, 1, 1)
    diag = (eye * ch_weight.reshape(*lead, heads, d, 1, d, k_ch)).reshape(*lead, c, c, k_ch)
    per_pair = diag.unsqueeze(-1) * seq_weight[..., 0, :].reshape(*lead, 1, c, 1, k_seq)
    taps = (torch.nn.functional.pad(per_pair[..., a, :], (a, k_total - k_seq - a)) for a in range(k_ch))
    summed = functools.reduce(torch.add, taps)  # as the builders sum: no leading 0 to flip a -0.0
    newest = torch.nn.functional.pad(mean_mix.unsqueeze(-1), (k_total - 1, 0))
    return (summed + newest).reshape(*lead, c, c * k_total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lead", "heads", "d", "k_seq", "k_ch"),
    [((), 3, 5, 2, 2), ((4,), 16, 8, 2, 2), ((2,), 5, 4, 3, 2), ((3,), 2, 6, 1, 3)],
)
def test_the_folded_weight_from_its_diagonal_blocks_equals_the_dense_construction(
    dtype, lead, heads, d, k_seq, k_ch
):
    """Bit for bit, signed zeros included, on fresh random parameters and a full q-k mix."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    c = heads * d
    seq_w, ch_w = (
        torch.randn(*lead, c, 1, k_seq, generator=gen),
        torch.randn(*lead, c, d, k_ch, generator=gen),
    )
    seq_b, ch_b, mix = (
        torch.randn(*lead, c, generator=gen),
        torch.randn(*lead, c, generator=gen),
        torch.randn(*lead, c, c, generator=gen),
    )
    seq_w, ch_w, seq_b, ch_b, mix = (t.to(dtype) for t in (seq_w, ch_w, seq_b, ch_b, mix))
    weight, _ = ccgqa_fold.folded_qk_weight(seq_w, seq_b, ch_w, ch_b, mix)
    want = _dense_folded_weight(seq_w, ch_w, mix)
    assert weight.dtype == want.dtype and torch.equal(weight, want), f"seed {seed}"
    assert torch.equal(torch.signbit(weight), torch.signbit(want)), f"seed {seed}"
