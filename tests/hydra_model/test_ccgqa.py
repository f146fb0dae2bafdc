"""CCGQA against an independent fp64 implementation of the steps ccgqa.py lists, plus the single
properties one by one (latent widths, conv causality, q-k mean, value shift, temperature) and
cached decoding against the full forward."""

from __future__ import annotations

import math

import pytest
import torch

import hydra_model.ccgqa as ccgqa_mod
import hydra_model.ccgqa_fold as ccgqa_fold
from hydra_model import CCGQAAttention, RotaryEmbedding
from hydra_model.cache import CacheSlot

E, HQ, HKV, D, R = 40, 4, 2, 10, 4  # latent q width 40 (C = 1), kv width 20, head size 10


def make_attention(seed=0, k_seq=2, k_ch=2, rotary=R, conv_impl="headwise") -> CCGQAAttention:
    torch.manual_seed(seed)
    attn = CCGQAAttention(E, HQ, HKV, D, rotary, k_seq, k_ch, conv_impl=conv_impl)
    with torch.no_grad():  # non-trivial biases and temperatures, so the reference has to use them
        attn.conv_seq.bias.normal_()
        attn.conv_ch.bias.normal_()
        attn.temperature.normal_(std=0.5)
    return attn


def reference(attn: CCGQAAttention, x: torch.Tensor, pos: torch.Tensor, base=10000.0) -> torch.Tensor:
    """Steps 1–8 in fp64 with explicit loops; x [B, n, E], pos [B, n] original positions."""
    x = x.double()
    b, n, _ = x.shape
    qd, kvd, half = HQ * D, HKV * D, HKV * D // 2
    w = attn.w_qkv.weight.double()
    q_pre, k_pre = x @ w[:qd].t(), x @ w[qd : qd + kvd].t()
    v_cur, v_src = x @ w[qd + kvd : qd + kvd + half].t(), x @ w[qd + kvd + half :].t()
    u = torch.cat([q_pre, k_pre], -1)  # [B, n, C]
    c_total = u.shape[-1]
    ks, kc = attn.k_seq, attn.k_ch
    w1, b1 = attn.conv_seq.weight.double()[:, 0], attn.conv_seq.bias.double()  # [C, ks]
    w2, b2 = attn.conv_ch.weight.double(), attn.conv_ch.bias.double()  # [C, D, kc]

    def u_at(t):  # input with zero left padding
        return u[:, t] if t >= 0 else torch.zeros(b, c_total, dtype=torch.float64)

    def y1_at(t):  # depthwise conv output at (possibly negative) time t
        return b1 + sum(w1[:, j] * u_at(t - (ks - 1) + j) for j in range(ks))

    z = torch.zeros(b, n, c_total, dtype=torch.float64)
    for t in range(n):
        for head in range(HQ + HKV):
            sl = slice(head * D, (head + 1) * D)
            acc = b2[sl].clone().expand(b, D).clone()
            for i in range(kc):
                acc = acc + y1_at(t - (kc - 1) + i)[:, sl] @ w2[sl, :, i].t()
            z[:, t, sl] = acc
    groups = HQ // HKV
    qh = z[..., :qd].reshape(b, n, HQ, D).clone()
    kh = z[..., qd:].reshape(b, n, HKV, D).clone()
    qp, kp = q_pre.reshape(b, n, HQ, D), k_pre.reshape(b, n, HKV, D)
    for h in range(HQ):
        qh[:, :, h] += (qp[:, :, h] + kp[:, :, h // groups]) / 2
    for g in range(HKV):
        kh[:, :, g] += (
            sum((qp[:, :, h] + kp[:, :, g]) / 2 for h in range(g * groups, (g + 1) * groups)) / groups
        )
    v_prev = torch.cat([torch.zeros(b, 1, half, dtype=torch.float64), v_src[:, :-1]], 1)
    v = torch.cat([v_cur, v_prev], -1).reshape(b, n, HKV, D)
    qh = qh / qh.norm(dim=-1, keepdim=True) * math.sqrt(D)
    kh = (
        kh / kh.norm(dim=-1, keepdim=True) * math.sqrt(D) * attn.temperature.double().exp().view(1, 1, HKV, 1)
    )
    if attn.rotary_dim:
        hr = attn.rotary_dim // 2
        inv = base ** (-torch.arange(hr, dtype=torch.float64) * 2 / attn.rotary_dim)
        ang = pos.double().unsqueeze(-1) * inv  # [B, n, R/2]
        cos, sin = ang.cos().unsqueeze(2), ang.sin().unsqueeze(2)

        def rot(t):
            a, bb, rest = t[..., :hr], t[..., hr : 2 * hr], t[..., 2 * hr :]
            return torch.cat([a * cos - bb * sin, bb * cos + a * sin, rest], -1)

        qh, kh = rot(qh), rot(kh)
    out = torch.zeros(b, n, HQ, D, dtype=torch.float64)
    for h in range(HQ):
        scores = torch.einsum("bsd,btd->bst", qh[:, :, h], kh[:, :, h // groups]) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ v[:, :, h // groups]
    return out.reshape(b, n, qd) @ attn.w_o.weight.double().t()


def run(attn, x, pos, **kw):
    rope = RotaryEmbedding(attn.rotary_dim, 64)
    cos, sin = rope.tables(positions=pos)
    return attn(x, cos, sin, **kw)


@pytest.mark.parametrize("conv_impl", ccgqa_mod.CONV_IMPLS)
@pytest.mark.parametrize(("k_seq", "k_ch", "rotary"), [(2, 2, R), (3, 2, R), (1, 3, 0), (2, 1, D)])
def test_matches_independent_fp64_reference(k_seq, k_ch, rotary, conv_impl):
    attn = make_attention(k_seq=k_seq, k_ch=k_ch, rotary=rotary, conv_impl=conv_impl)
    x = torch.randn(2, 11, E)
    pos = torch.tensor([[0, 1, 2, 4, 7, 8, 9, 15, 16, 20, 33], list(range(11))])  # original positions
    torch.testing.assert_close(run(attn, x, pos).double(), reference(attn, x, pos), atol=2e-5, rtol=2e-5)


def test_latent_widths():
    attn = make_attention()
    assert attn.w_qkv.weight.shape == (HQ * D + 2 * HKV * D, E)  # W_q | W_k | W_v1 | W_v2, no bias
    assert attn.w_qkv.bias is None and attn.w_o.bias is None
    assert attn.w_o.weight.shape == (E, HQ * D)
    assert attn.conv_seq.groups == HQ * D + HKV * D and attn.conv_seq.kernel_size == (2,)
    assert attn.conv_ch.groups == HQ + HKV and attn.conv_ch.weight.shape == ((HQ + HKV) * D, D, 2)
    assert attn.conv_seq.bias is not None and attn.conv_ch.bias is not None
    assert attn.conv_context == 2
    assert torch.equal(CCGQAAttention(E, HQ, HKV, D, R).temperature, torch.zeros(HKV))


@pytest.mark.parametrize("conv_impl", ccgqa_mod.CONV_IMPLS)
def test_conv_and_attention_are_causal(conv_impl):
    attn = make_attention(k_seq=3, k_ch=3, conv_impl=conv_impl)
    x = torch.randn(2, 12, E)
    pos = torch.arange(12).expand(2, 12)
    y = run(attn, x, pos)
    for t0 in (1, 5, 11):
        x2 = x.clone()
        x2[:, t0:] = torch.randn_like(x2[:, t0:])
        y2 = run(attn, x2, pos)
        torch.testing.assert_close(y2[:, :t0], y[:, :t0], atol=0, rtol=0)
        assert (y2[:, t0] - y[:, t0]).abs().max() > 1e-4


class Capture:
    def __init__(self, monkeypatch):
        self.calls = []
        real = ccgqa_mod.flexible_attention

        def spy(q, k, v, *args, **kw):
            self.calls.append((q.detach(), k.detach(), v.detach()))
            return real(q, k, v, *args, **kw)

        monkeypatch.setattr(ccgqa_mod, "flexible_attention", spy)


@pytest.mark.parametrize("conv_impl", ccgqa_mod.CONV_IMPLS)
def test_value_shift_qk_mean_and_temperature(monkeypatch, conv_impl):
    attn = make_attention(rotary=0, conv_impl=conv_impl)
    with torch.no_grad():  # silence the convs: q, k are then exactly the normalised q-k means
        for conv in (attn.conv_seq, attn.conv_ch):
            conv.weight.zero_()
            conv.bias.zero_()
    cap = Capture(monkeypatch)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    attn.double()
    run(attn, x, torch.arange(6).expand(2, 6))
    q, k, v = cap.calls[0]  # [B, H, n, D]
    w = attn.w_qkv.weight
    qd, kvd, half = HQ * D, HKV * D, HKV * D // 2
    q_pre = (x @ w[:qd].t()).reshape(2, 6, HQ, D).transpose(1, 2)
    k_pre = (x @ w[qd : qd + kvd].t()).reshape(2, 6, HKV, D).transpose(1, 2)
    # q-k mean: query head h gets (q_pre[h] + k_pre[h // G]) / 2, kv head g the mean over its group
    mean_q = (q_pre + k_pre.repeat_interleave(2, 1)) / 2
    mean_k = torch.stack([mean_q[:, 2 * g : 2 * g + 2].mean(1) for g in range(HKV)], 1)
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(q, unit(mean_q) * math.sqrt(D))
    temp = attn.temperature.detach().double().exp().view(1, HKV, 1, 1)
    torch.testing.assert_close(k, unit(mean_k) * math.sqrt(D) * temp)
    torch.testing.assert_close(k.norm(dim=-1), (math.sqrt(D) * temp.squeeze(-1)).expand(2, HKV, 6))
    # value shift: first half of the value channels from x_t, second half from x_{t−1}, zero at t = 0
    vv = v.transpose(1, 2).reshape(2, 6, kvd)
    torch.testing.assert_close(vv[..., :half], x @ w[qd + kvd : qd + kvd + half].t())
    torch.testing.assert_close(vv[:, 1:, half:], x[:, :-1] @ w[qd + kvd + half :].t())
    assert torch.count_nonzero(vv[:, 0, half:]) == 0


@pytest.mark.parametrize("conv_impl", ccgqa_mod.CONV_IMPLS)
def test_decoding_with_cache_equals_full_forward_of_the_member_tokens(conv_impl):
    """Prefill from a prefix-member sequence, then decode with some tokens skipping the layer: each
    written token's output equals a fresh full forward over that sequence's held tokens."""
    attn = make_attention(k_seq=3, k_ch=2, conv_impl=conv_impl).double()
    torch.manual_seed(5)
    b, n = 2, 7
    x = torch.randn(b, n, E, dtype=torch.float64)
    pos = torch.tensor([[0, 2, 3, 5, 6, 9, 10], [1, 2, 4, 5, 7, 8, 11]])
    counts = torch.tensor([3, 5])  # the first count[b] rows are real, the tail is filler
    member = torch.arange(n).view(1, -1) < counts.view(-1, 1)
    slot = CacheSlot(capacity=n + 6)
    run(attn, x, pos, slot=slot, member=member)
    held = [[(x[i, j], pos[i, j]) for j in range(counts[i])] for i in range(b)]
    writes = [[True, False], [True, True], [False, True], [True, True]]
    next_pos = torch.tensor([12, 13])
    for w in writes:
        xt = torch.randn(b, 1, E, dtype=torch.float64)
        write = torch.tensor(w).view(b, 1)
        out = run(attn, xt, next_pos.view(b, 1), slot=slot, member=write)
        for i in range(b):
            if w[i]:
                held[i].append((xt[i, 0], next_pos[i]))
                xs = torch.stack([t for t, _ in held[i]]).unsqueeze(0)
                ps = torch.stack([p for _, p in held[i]]).view(1, -1)
                full = run(attn, xs, ps)
                torch.testing.assert_close(out[i, 0], full[0, -1], atol=1e-10, rtol=1e-10)
        next_pos = next_pos + 1
    assert slot.entry.length.tolist() == [len(h) for h in held]


def conv_case(heads, d, k_seq, k_ch, seed):
    """Random fp64 conv parameters (with gradients), a window [2, 9 + K−1, C] and the reference:
    F.conv1d depthwise then head-wise grouped, as [2, 9, C]."""
    g = torch.Generator().manual_seed(seed)
    c, k_total = heads * d, k_seq + k_ch - 1
    params = (
        torch.randn(c, 1, k_seq, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(c, d, k_ch, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True),
    )
    w1, b1, w2, b2 = params
    win = torch.randn(2, 9 + k_total - 1, c, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.conv1d(
        torch.nn.functional.conv1d(win.transpose(1, 2), w1, b1, groups=c), w2, b2, groups=heads
    ).transpose(1, 2)
    return params, win, ref, torch.randn(ref.shape, generator=g, dtype=torch.float64)


def assert_same_function_and_gradients(got, ref, grad, params):
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    want = torch.autograd.grad(ref, params, grad)
    have = torch.autograd.grad(got, params, grad)
    for a, b in zip(have, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    ("heads", "d", "k_seq", "k_ch"), [(3, 5, 2, 2), (5, 4, 3, 2), (2, 6, 1, 3), (4, 3, 2, 1)]
)
def test_folded_conv_weight_equals_the_two_convolutions(heads, d, k_seq, k_ch):
    """folded_qk_weight against F.conv1d (depthwise, then head-wise grouped) in fp64, mean-mix
    zero, on unpadded windows; gradients of the conv parameters flow through the folding."""
    params, win, ref, grad = conv_case(heads, d, k_seq, k_ch, seed=heads * 10 + d)
    c, k_total = heads * d, k_seq + k_ch - 1
    weight, bias = ccgqa_fold.folded_qk_weight(*params, torch.zeros(c, c, dtype=torch.float64))
    taps = win.unfold(1, k_total, 1).reshape(2, 9, c * k_total)
    got = torch.nn.functional.linear(taps, weight, bias)
    assert_same_function_and_gradients(got, ref, grad, params)


@pytest.mark.parametrize(
    ("heads", "d", "k_seq", "k_ch"), [(3, 5, 2, 2), (5, 4, 3, 2), (2, 6, 1, 3), (4, 3, 2, 1)]
)
def test_headwise_conv_weight_equals_the_two_convolutions(heads, d, k_seq, k_ch):
    """headwise_qk_weight (one GEMM per head) against F.conv1d (depthwise, then head-wise grouped)
    in fp64 on unpadded windows; gradients of the conv parameters flow through the folding."""
    params, win, ref, grad = conv_case(heads, d, k_seq, k_ch, seed=heads * 7 + d)
    c, k_total = heads * d, k_seq + k_ch - 1
    weight, bias = ccgqa_fold.headwise_qk_weight(*params)
    assert weight.shape == (heads, d, d * k_total)
    taps = win.unfold(1, k_total, 1).reshape(2, 9, heads, d * k_total)
    got = (torch.einsum("bngk,gok->bngo", taps, weight) + bias.view(heads, d)).reshape(2, 9, c)
    assert_same_function_and_gradients(got, ref, grad, params)


def test_conv_impls_agree_on_outputs_and_gradients():
    """The two forms of the conv stage are the same function of the same parameters."""
    torch.manual_seed(3)
    a = CCGQAAttention(48, 6, 2, 8, 4, 2, 2, conv_impl="headwise").double()
    b = CCGQAAttention(48, 6, 2, 8, 4, 2, 2, conv_impl="folded").double()
    with torch.no_grad():  # non-trivial biases, so both folds must carry them
        a.conv_seq.bias.copy_(torch.linspace(-1, 1, a.qk_channels))
        a.conv_ch.bias.normal_()
    b.load_state_dict(a.state_dict())
    rope = RotaryEmbedding(4, 32)
    x = torch.randn(3, 13, 48, dtype=torch.float64)
    outs = [m(x, *rope.tables(13)) for m in (a, b)]
    # the QK norm and RoPE ops keep fp32 statistics and tables: the two sums of the same fp64
    # terms can round differently there, hence fp32-level tolerances (a wrong fold is off by O(1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    g = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(o, list(m.parameters()), g) for o, m in zip(outs, (a, b), strict=True)]
    for ga, gb in zip(*grads, strict=True):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)


def test_qk_mean_matrix_matches_the_head_formula():
    hq, hkv, d = 6, 2, 3
    m = ccgqa_mod.qk_mean_matrix(hq, hkv, d).double()
    u = torch.randn(4, (hq + hkv) * d, dtype=torch.float64)
    q_pre, k_pre = u[:, : hq * d].reshape(4, hq, d), u[:, hq * d :].reshape(4, hkv, d)
    groups = hq // hkv
    want_q = torch.stack([(q_pre[:, h] + k_pre[:, h // groups]) / 2 for h in range(hq)], 1)
    want_k = torch.stack([want_q[:, g * groups : (g + 1) * groups].mean(1) for g in range(hkv)], 1)
    torch.testing.assert_close(u @ m.t(), torch.cat([want_q.reshape(4, -1), want_k.reshape(4, -1)], -1))


def test_folded_weight_is_built_once_per_decoding_slot_and_per_call_elsewhere(monkeypatch):
    """Without a slot the head-wise weight is built each call; a decoding slot's prefill builds
    the decode steps' window tiles once (its short prompt's convs use them too) and the joint q/k
    temperatures of its QK norm, and no decode step builds anything."""
    torch.manual_seed(7)
    attn = CCGQAAttention(24, 4, 2, 6, 4)
    rope = RotaryEmbedding(4, 16)
    x = torch.randn(2, 9, 24)
    built = []
    real = ccgqa_fold.fold_many
    monkeypatch.setattr(ccgqa_fold, "fold_many", lambda mods, form: built.append(form) or real(mods, form))
    with torch.no_grad():
        attn(x, *rope.tables(9))
        attn(x, *rope.tables(9))
        assert built == ["headwise", "headwise"]  # no slot: built per call (weights may change)
        slot = CacheSlot(16)
        attn(x[:, :5], *rope.tables(5), slot=slot)  # prefill
        for t in range(5, 9):
            cos, sin = rope.tables(positions=torch.full((2, 1), t))
            attn(x[:, t : t + 1], cos, sin, slot=slot)
        # once for the whole generation, with the short prefill's joint q/k temperatures
        assert built == ["headwise", "headwise", "window_tiles", "joint_temperature"]


def test_a_short_prefill_with_a_slot_equals_the_plain_forward_with_random_temperatures():
    """The short prefill normalises and rotates q and k as one tensor (the joint temperature: zeros
    for the query heads, the key temperature for the kv heads); the plain forward does them apart.
    With random temperatures (a swap of heads would show) and per-sequence positions, batch 3."""
    seed = int(torch.seed() % 2**31)
    attn = CCGQAAttention(48, 6, 2, 8, 4).eval()
    rope = RotaryEmbedding(4, 32)
    with torch.no_grad():
        attn.temperature.normal_()
        for p in (attn.conv_seq.weight, attn.conv_ch.weight):
            p.normal_()
        x = torch.randn(3, 7, 48)
        pos = torch.randint(0, 20, (3, 1)) + torch.arange(7)  # [B, n]: each sequence's own positions
        cos, sin = rope.tables(positions=pos)
        plain = attn(x, cos, sin)
        prefill = attn(x, cos, sin, slot=CacheSlot(16))
    torch.testing.assert_close(prefill, plain, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_conv_stage_through_the_kernel_matches_the_two_convolutions_in_fp64(monkeypatch):
    """The model's conv stage with hydra_kernels' ccgqa_conv (interpreted here; the suite's
    conftest turns kernels off, this test on): q and k, and the gradients of the window and the
    conv parameters, against fp64 F.conv1d (depthwise, then head-wise grouped) plus the q-k mean,
    computed from the module's parameters without the fold. Heads of 16: a width the kernel takes."""
    import torch.nn.functional as F

    import hydra_kernels
    from hydra_kernels.ops import ccgqa_conv as conv_op

    if not hydra_kernels.controls.device_supports_triton(torch.device("cpu")):
        pytest.skip("needs the Triton interpreter")
    hq, hkv, d, b, n = 2, 1, 16, 2, 70
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    attn = CCGQAAttention(64, hq, hkv, d, 8, 2, 2)
    with torch.no_grad():
        attn.conv_seq.bias.normal_()
        attn.conv_ch.bias.normal_()
    c, ctx = (hq + hkv) * d, attn.conv_context
    window = torch.randn(b, n + ctx, c)
    window[:, :ctx] = 0  # a sequence start: left context zeros, as the forward pads it
    window.requires_grad_()
    launches = []
    real = conv_op.ccgqa_conv_fwd_launch
    monkeypatch.setattr(conv_op, "ccgqa_conv_fwd_launch", lambda *a: launches.append(1) or real(*a))
    hydra_kernels.set_use_triton_kernels(True)
    try:
        q, k = attn._conv_qk(window)
    finally:
        hydra_kernels.set_use_triton_kernels(False)
    assert launches, "the kernel did not run"
    params = [attn.conv_seq.weight, attn.conv_seq.bias, attn.conv_ch.weight, attn.conv_ch.bias]
    up_q, up_k = torch.randn_like(q), torch.randn_like(k)
    got = torch.autograd.grad((q * up_q).sum() + (k * up_k).sum(), [window, *params])

    w64 = window.detach().double().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in params]
    z = F.conv1d(w64.transpose(1, 2), p64[0], p64[1], groups=c)  # [B, C, n + k_ch - 1]
    z = F.conv1d(z, p64[2], p64[3], groups=hq + hkv).transpose(1, 2)  # [B, n, C]
    u = w64[:, ctx:]
    qp, kp = u[..., : hq * d].reshape(b, n, hkv, hq // hkv, d), u[..., hq * d :].reshape(b, n, hkv, 1, d)
    mean = 0.5 * (qp + kp)
    q64 = z[..., : hq * d].reshape(b, n, hq, d) + mean.reshape(b, n, hq, d)
    k64 = z[..., hq * d :].reshape(b, n, hkv, d) + mean.mean(3)
    want = torch.autograd.grad((q64 * up_q.double()).sum() + (k64 * up_k.double()).sum(), [w64, *p64])
    torch.testing.assert_close(q.double(), q64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), k64, rtol=1e-5, atol=1e-5)
    names = ("window", "seq weight", "seq bias", "ch weight", "ch bias")
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=name)


def test_training_forward_reads_u_in_place_as_the_padded_window_would(monkeypatch):
    """A training forward hands the conv kernels u [B, n, C] with its zero context implied
    (``zero_context``): output and every gradient bit for bit those of the same forward given the
    zero-padded window, with hydra_kernels' kernels on (interpreted here)."""
    import torch.nn.functional as F

    import hydra_kernels

    if not hydra_kernels.controls.device_supports_triton(torch.device("cpu")):
        pytest.skip("needs the Triton interpreter")
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    attn = CCGQAAttention(64, 2, 1, 16, 8, 2, 2)
    x = torch.randn(2, 37, 64, requires_grad=True)
    cos, sin = RotaryEmbedding(8, 64).tables(37)
    real, calls = ccgqa_mod.ccgqa_conv, []
    from hydra_kernels.ops import ccgqa_conv as conv_op

    launches, launch = [], conv_op.ccgqa_conv_fwd_launch  # a[3]: zero_context
    monkeypatch.setattr(conv_op, "ccgqa_conv_fwd_launch", lambda *a: launches.append(a[3]) or launch(*a))

    def padded(window, weight, bias, zero_context=False, qk_mean_heads=0):
        calls.append(zero_context)
        if zero_context:  # the old way: a padded copy, read from its first row
            window = F.pad(window, (0, 0, weight.shape[1] - 1, 0))
        return real(window, weight, bias, qk_mean_heads=qk_mean_heads)

    hydra_kernels.set_use_triton_kernels(True)
    try:
        results = []
        for fn in (real, padded):
            monkeypatch.setattr(ccgqa_mod, "ccgqa_conv", fn)
            out = attn(x, cos, sin)
            results.append((out, *torch.autograd.grad(out.square().sum(), [x, *attn.parameters()])))
    finally:
        hydra_kernels.set_use_triton_kernels(False)
    assert calls == [True], calls  # the training forward took the in-place path
    assert launches == [True, False], launches  # the kernels ran: u in place, then the padded copy
    assert hydra_kernels.fallback_counts()["ccgqa_conv"] == 0
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
