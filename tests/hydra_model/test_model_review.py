"""Model API review: what a forward without gradients may change, what MoEFFN and the forwards
refuse, and that the losses pair each position with its own target."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hydra_model import MoEFFN, build_model, compute_memory_footprint

from .conftest import random_tokens, small_model
from .test_gpt import random_model

LOSS_FREE = dict(moe_enabled=True, moe_num_experts=4, moe_top_k=2, moe_balancing="loss_free")


def _models():
    return {"hydra": small_model(), "gpt": random_model("gqa")}


def _trained_loss_free(seed: int):
    """A loss-free MoE model after a few training steps: biases moved and a load pending."""
    model = small_model(seed=seed, **LOSS_FREE).train()
    x, y = random_tokens(2, 21, seed=seed + 1), random_tokens(2, 21, seed=seed + 2)
    for _ in range(3):
        model(x, targets=y).loss.backward()
    assert model.moe_layers()[0].pending_load.sum() > 0
    return model


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_a_training_mode_forward_without_gradients_leaves_the_balancing_biases(no_grad):
    """Like the causal thresholds (recorded and committed only by forwards with gradients), the
    loss-free biases move only with training forwards that train: a forward under no_grad in
    training mode (a training-mode evaluation) changed them, so two identical calls differed."""
    seed = int(torch.randint(0, 1000, ()))
    model = _trained_loss_free(seed)
    before = copy.deepcopy(model.state_dict())
    x = random_tokens(2, 17, seed=seed + 3)
    with no_grad():
        first = model(x).logits.clone()
        second = model(x).logits
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    # a forward with gradients still applies the pending load and counts its own
    layer = model.moe_layers()[0]
    pending = layer.pending_load.clone()
    model(x, targets=x).loss.backward()
    step = torch.sign(pending.mean() - pending) * layer.bias_update_rate
    torch.testing.assert_close(layer.balance_bias, before[_bias_name(model, layer)] + step)
    assert layer.pending_load.sum() > 0


def _bias_name(model, layer) -> str:
    return next(n for n, m in model.named_modules() if m is layer) + ".balance_bias"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_experts=2, top_k=3), "top_k=3"),
        (dict(n_experts=4, top_k=0), "top_k=0"),
        (dict(n_experts=0, top_k=1), "n_experts=0"),
        (dict(n_experts=4, top_k=1, balancing="none"), "balancing='none'"),
    ],
)
def test_moe_ffn_refuses_what_it_cannot_route(kwargs, message):
    """top_k > n_experts failed only at the first forward (torch's "selected index k out of
    range"); top_k=0 returned zeros and an unknown balancing balanced nothing, silently."""
    with pytest.raises(ValueError, match=message):
        MoEFFN(8, 16, **kwargs)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("chunked", [False, True])
def test_targets_of_another_shape_are_refused_not_paired_with_the_wrong_positions(arch, chunked):
    """targets [S, B] or [B·S, 1] for input_ids [B, S] hold as many numbers, and the loss was
    computed over the flattened pairs: position t scored against another position's target."""
    model = _models()[arch]
    model.config.use_chunked_ce = chunked
    x = random_tokens(2, 6, vocab=model.config.vocab_size)
    for bad in (x.t(), x.reshape(-1, 1), x.reshape(-1)):
        with pytest.raises(ValueError, match=r"targets .* must have input_ids' shape \(2, 6\)"):
            model(x, targets=bad)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("chunked", [False, True])
def test_int32_targets_give_the_int64_loss(arch, chunked):
    """int32 ids are taken; int32 targets (the same array shifted) failed in cross_entropy
    ("expected target dtype to be Long") unless the chunked loss ran."""
    model = _models()[arch].eval()
    model.config.use_chunked_ce = chunked
    v = model.config.vocab_size
    x, y = random_tokens(2, 9, vocab=v, seed=4), random_tokens(2, 9, vocab=v, seed=5)
    y[0, :2] = -100
    with torch.no_grad():
        ref = model(x, targets=y).ce_loss
        got = model(x.int(), targets=y.int()).ce_loss
        logits = model(x).logits.double()
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    independent = F.cross_entropy(logits.reshape(-1, v), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got.double(), independent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_malformed_input_ids_are_refused_by_name(arch):
    """A 1-D or empty sequence failed deep inside (an unpacking error, a torch.cat size error in
    the CCGQA value shift); float ids in the embedding; an id past the vocabulary as torch's
    "index out of range in self", which names neither the id nor vocab_size."""
    model = _models()[arch]
    v = model.config.vocab_size
    x = random_tokens(2, 5, vocab=v)
    with pytest.raises(ValueError, match=r"input_ids .*\(5,\).* \[batch, seq\]"):
        model(x[0])
    with pytest.raises(ValueError, match=r"input_ids .*\(2, 0\).* no tokens"):
        model(x[:, :0])
    with pytest.raises(ValueError, match=r"input_ids .*integer"):
        model(x.float())
    with pytest.raises(ValueError, match=r"targets .*integer"):
        model(x, targets=x.float())
    for bad in (v, -1):
        x_bad = x.clone()
        x_bad[1, 3] = bad
        with pytest.raises(ValueError, match=rf"input_ids hold {bad}.*vocab_size={v}"):
            model(x_bad)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_a_batch_with_every_target_ignored_has_the_chunked_loss_zero_not_nan(arch):
    """The logits path took torch's mean over no tokens (NaN: a training step skipped as
    non-finite, a NaN in the logged loss) where the chunked path gives 0 and zero gradients;
    with targets left, it is still torch's mean, bit for bit, gradients included."""
    model = _models()[arch].train()
    model.config.use_chunked_ce = False
    v = model.config.vocab_size
    x = random_tokens(2, 7, vocab=v, seed=8)
    out = model(x, targets=torch.full_like(x, -100))
    out.ce_loss.backward()
    assert out.ce_loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad()
    y = random_tokens(2, 7, vocab=v, seed=9)
    y[1, 2:] = -100
    model.eval()
    got = model(x, targets=y)
    got.ce_loss.backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(x).logits
    ref = F.cross_entropy(logits.float().reshape(-1, v), y.reshape(-1), ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(got.ce_loss, ref, atol=0, rtol=0)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(mine[n], p.grad, atol=0, rtol=0, msg=n)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_checkpointing_never_raises_the_activation_estimate(arch):
    """Checkpointing keeps a block's input instead of its activations and recomputes one block at
    a time in the backward, after the blocks above it freed theirs: the peak never exceeds that
    of no checkpointing. The estimate added the largest block on top of every block kept whole,
    so every=2 on HYDRA's tiny preset (two blocks) estimated more than no checkpointing."""
    model = build_model(arch, "tiny", vocab_size=101)
    blocks = len(model.blocks) if arch == "hydra" else len(model.layers)
    plain = compute_memory_footprint(model, 2, 64)["activation_mb"]
    estimates = []
    for every in range(1, blocks + 2):
        model.enable_gradient_checkpointing(every=every)
        estimates.append(compute_memory_footprint(model, 2, 64)["activation_mb"])
        assert estimates[-1] < plain, every
    assert estimates[0] == min(estimates)  # every block checkpointed: the least kept


def _saved_and_grads(model, x, y):
    saved = []
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        out = model(x, targets=y)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(saved)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_checkpointing_of_either_arch_gives_the_same_fp64_loss_and_gradients(arch):
    """Every N (each block, every other, only the first), MoD, MoR and MoE routing on: the same
    loss and gradients bit for bit in fp64, fewer tensors saved for the backward, and none of it
    once turned off."""
    extra = dict(moe_enabled=True, moe_num_experts=3, moe_top_k=2) if arch == "hydra" else {}
    base = (small_model(**extra) if arch == "hydra" else random_model("ccgqa")).double().train()
    fresh = copy.deepcopy(base)  # before any forward: the same routing state for every copy
    v = base.config.vocab_size
    x, y = random_tokens(2, 15, vocab=v, seed=11), random_tokens(2, 15, vocab=v, seed=12)
    y[0, :4] = -100
    loss, grads, saved = _saved_and_grads(base, x, y)
    for every in (1, 2, 3):
        model = copy.deepcopy(fresh)
        model.enable_gradient_checkpointing(every=every)
        got, got_grads, got_saved = _saved_and_grads(model, x, y)
        assert got_saved < saved, every
        torch.testing.assert_close(got, loss, atol=0, rtol=0)
        for n, g in grads.items():
            torch.testing.assert_close(got_grads[n], g, atol=0, rtol=0, msg=f"every={every}: {n}")
    model = copy.deepcopy(fresh)
    model.enable_gradient_checkpointing(every=1)
    model.disable_gradient_checkpointing()
    assert _saved_and_grads(model, x, y)[2] == saved
