"""CCGQA's two convs and q-k mean folded into GEMM weights, for one module or many at once.

The depthwise conv along the sequence, then the head-wise grouped conv, are linear in the packed
pre-conv inputs of the last K = k_seq + k_ch − 1 tokens, so they fold into one weight (ccgqa.py
says how each form is used):

* ``headwise``: [heads, d, d·K], one small GEMM per head (the q-k mean added apart);
* ``folded``: [C, C·K], block diagonal, with the q-k mean inside (columns c·K + s);
* ``window``: the folded weight with its columns in a decode window's memory order (s·C + c);
* ``window_tiles``: the window weight as its non-zero tiles (hydra_kernels' ``tile_linear``).

Why many at once: a generation builds these once (the weights cannot change while decoding), and
at batch 1 the build is bound by kernel launches, not arithmetic: about ten launches per module
for the head-wise weight of a prefill and thirty for the tiles of the first decode step, which
for the twelve blocks of HYDRA's 100M preset was more launches than a whole decode step.
:func:`fold_many` builds one form for a list of same-shaped modules with the same launches as for
one (their parameters stacked first), and a cache's :class:`~hydra_model.cache.ConvBank` asks for
every CCGQA module of the model at the first module's request (:func:`fold_into_bank`). Every
element is computed by the same elementwise ops either way: the weights are bitwise those of one
module alone (the bias's sums over a head's channels may be ordered differently by a batched
reduction).

The builders take any leading batch dimensions and use elementwise ops only (no matmul), so
autocast leaves them in the parameters' dtype; they are differentiable, so a training forward's
conv parameters get their gradients through them. Without gradients, where hydra_kernels' Triton
path is on, the decode steps' ``window_tiles`` form comes from one kernel instead
(``hydra_kernels.ops.ccgqa_window_tiles``: the tiles computed directly, no dense window weight).
"""

from __future__ import annotations

from functools import reduce

import torch
import torch.nn.functional as F

from hydra_kernels.ops.ccgqa_window_tiles import ccgqa_window_tiles, kernel_path
from hydra_kernels.ops.tile_linear import TiledWeight, TileLayout, pack_tiles_many, tile_layout, tile_nonzero

#: the forms a module's conv weights come in (see the module docstring)
FOLD_FORMS = ("headwise", "folded", "window", "window_tiles")
#: what a bank keeps besides the conv weights: the QK norm's temperatures of a module's query
#: heads (zeros) and kv heads, one [n_heads + n_kv_heads] vector (ccgqa.py's short prefill)
JOINT_TEMPERATURE = "joint_temperature"
#: the window weight's tile (rows, columns) for decode_conv="window_tiles" (hydra_kernels' tile_linear)
WINDOW_TILE = (64, 64)


def _tap_sum(per_pair: torch.Tensor, k_seq: int, k_total: int) -> torch.Tensor:
    """[..., k_ch, k_seq] products of conv taps → [..., K]: ch tap a over seq tap b reads the
    input at window offset a + b."""
    k_ch = per_pair.shape[-2]
    return reduce(torch.add, (F.pad(per_pair[..., a, :], (a, k_total - k_seq - a)) for a in range(k_ch)))


def folded_qk_weight(
    seq_weight: torch.Tensor,
    seq_bias: torch.Tensor,
    ch_weight: torch.Tensor,
    ch_bias: torch.Tensor,
    mean_mix: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [..., C, C·K], bias [..., C]) such that ``taps @ weight.T + bias`` equals depthwise
    conv (``seq_weight`` [..., C, 1, k_seq]) → head-wise grouped conv (``ch_weight`` [..., C, d,
    k_ch], C/d groups) → + q-k mean (``mean_mix`` [..., C, C] applied to the newest input), where
    ``taps[c·K + s]`` is the input at window offset s (s = K−1 is the current token)."""
    *lead, c, d, _ = ch_weight.shape
    heads = c // d
    blocks = _head_blocks(seq_weight, ch_weight)  # [..., g, o, i, K]
    k_total = blocks.shape[-1]
    # the q-k mean on the newest tap, then each head's block added on the diagonal: out channel
    # (g, o) reads in channels (g, i) only. Only the blocks are computed: the dense product with
    # an identity over heads this replaces did heads× the work (packages/hydra-model/BENCHMARKS.md)
    weight = F.pad(mean_mix.to(blocks.dtype).unsqueeze(-1), (k_total - 1, 0))  # [..., C, C, K]
    diagonal = weight.view(*lead, heads, d, heads, d, k_total).diagonal(dim1=-5, dim2=-3)  # [..., o, i, K, g]
    diagonal.add_(blocks.movedim(-4, -1))
    return weight.reshape(*lead, c, c * k_total), _conv_bias(seq_bias, ch_weight, ch_bias)


def _conv_bias(seq_bias: torch.Tensor, ch_weight: torch.Tensor, ch_bias: torch.Tensor) -> torch.Tensor:
    """[..., C]: the grouped conv's bias plus the depthwise conv's bias carried through it (each
    output channel sums its head's d input channels)."""
    *lead, c, d, _ = ch_weight.shape
    w_ch = ch_weight.reshape(*lead, c // d, d, d, -1)  # [..., g, o, i, ch tap]
    return ch_bias + (w_ch.sum(-1) * seq_bias.reshape(*lead, c // d, 1, d)).sum(-1).reshape(*lead, c)


def headwise_qk_weight(
    seq_weight: torch.Tensor,
    seq_bias: torch.Tensor,
    ch_weight: torch.Tensor,
    ch_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [..., heads, d, d·K], bias [..., C]) such that, per head g, ``taps_g @ weight[g].T``
    plus bias equals depthwise conv (``seq_weight`` [..., C, 1, k_seq], ``seq_bias``) → head-wise
    grouped conv (``ch_weight`` [..., C, d, k_ch], ``ch_bias``, C/d groups), where ``taps_g[i·K + s]``
    is input channel i of head g at window offset s (s = K−1 is the current token). The q-k mean is
    not included (it crosses heads; the caller adds it)."""
    *lead, c, d, _ = ch_weight.shape
    blocks = _head_blocks(seq_weight, ch_weight)
    return blocks.reshape(*lead, c // d, d, -1), _conv_bias(seq_bias, ch_weight, ch_bias)


def _head_blocks(seq_weight: torch.Tensor, ch_weight: torch.Tensor) -> torch.Tensor:
    """[..., heads, d, d, K]: per head g, output channel o's coefficient on input channel i at
    window offset s, both convs folded (depthwise ``seq_weight`` [..., C, 1, k_seq], then head-wise
    ``ch_weight`` [..., C, d, k_ch])."""
    *lead, c, d, k_ch = ch_weight.shape
    k_seq = seq_weight.shape[-1]
    heads = c // d
    w_seq = seq_weight[..., 0, :].reshape(*lead, heads, 1, d, 1, k_seq)  # [..., g, ·, i, ·, seq tap]
    w_ch = ch_weight.reshape(*lead, heads, d, d, k_ch)  # [..., g, o, i, ch tap]
    per_pair = w_ch.unsqueeze(-1) * w_seq  # [..., g, o, i, ch tap, seq tap]
    return _tap_sum(per_pair, k_seq, k_seq + k_ch - 1)


def conv_params(module) -> tuple[torch.Tensor, ...]:
    """A CCGQA module's conv parameters: (seq weight, seq bias, ch weight, ch bias), the tensors
    every form is built from besides the q-k mean."""
    seq, ch = module.conv_seq, module.conv_ch
    return seq.weight, seq.bias, ch.weight, ch.bias


def _params(modules: list) -> tuple[torch.Tensor, ...]:
    """The modules' conv parameters, each stacked along a new first dimension (a view of the
    module's own tensor, no copy, for one module)."""
    tensors = list(zip(*(conv_params(m) for m in modules), strict=True))
    return tuple(ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts) for ts in tensors)


def _mean_mix(modules: list) -> torch.Tensor:
    mixes = [m.qk_mean_mix for m in modules]
    return mixes[0].unsqueeze(0) if len(mixes) == 1 else torch.stack(mixes)


def fold_many(modules: list, form: str) -> list[tuple[torch.Tensor | TiledWeight, torch.Tensor]]:
    """(weight, bias) in ``form`` for each of ``modules`` (CCGQA modules of one shape, dtype and
    device), built together: the launches of one module's build, not one build each."""
    if form == JOINT_TEMPERATURE:  # not a conv weight: the QK norm's temperatures of q and k together
        temps = torch.stack([m.temperature.detach() for m in modules])  # [L, n_kv_heads]
        joint = F.pad(temps, (modules[0].n_heads, 0))  # [L, n_heads + n_kv_heads]
        return [(t, None) for t in joint.unbind(0)]
    if form not in FOLD_FORMS:
        raise ValueError(f"conv weight form {form!r}; expected one of {', '.join(FOLD_FORMS)}")
    if form == "window_tiles" and not torch.is_grad_enabled() and kernel_path(modules[0].conv_seq.weight):
        return _window_tiles_kernel(modules)
    params = _params(modules)
    if form == "headwise":
        weight, bias = headwise_qk_weight(*params)
    else:
        weight, bias = folded_qk_weight(*params, _mean_mix(modules))  # [L, C, C·K], columns c·K + s
    if form in ("window", "window_tiles"):
        weight = _window_columns(weight)
    if form == "window_tiles":
        layout = window_tile_layout(modules[0], weight.device)
        return list(zip(pack_tiles_many(weight, *WINDOW_TILE, layout=layout), bias.unbind(0), strict=True))
    return list(zip(weight.unbind(0), bias.unbind(0), strict=True))


def _window_tiles_kernel(modules: list) -> list[tuple[TiledWeight, torch.Tensor]]:
    """The ``window_tiles`` form of every module in one launch (hydra_kernels'
    ``ccgqa_window_tiles``), reading each module's parameters where they are: no stacked copies
    and no dense window weight (about twenty launches and 250 MB of temporaries at the 100M
    preset op by op). Its sums are rounded once, where the op-by-op form rounds each product and
    partial sum: a 16-bit weight may differ from that form's in its last bit."""
    layout = window_tile_layout(modules[0], modules[0].conv_seq.weight.device)
    dtype = modules[0].conv_seq.weight.dtype
    params = [(*conv_params(m), m.qk_mean_mix.to(dtype)) for m in modules]
    tiles, bias = ccgqa_window_tiles(params, layout.index, *WINDOW_TILE)
    channels, k_total = modules[0].qk_channels, modules[0].conv_context + 1
    weights = (TiledWeight(t, layout.index, channels, k_total * channels) for t in tiles)
    return list(zip(weights, bias, strict=True))


def fold_blocks(attns: list) -> list | None:
    """Each CCGQA module of ``attns`` (a model's, one per block) in its ``conv_impl`` form, built
    together where they share a signature: what a forward without a cache hands its blocks. Each
    module building its own took about twenty traced ops a module and recursion (264 of the
    100M preset's training forward, packages/hydra-model/BENCHMARKS.md); one batched build takes
    about as many as one module's. None, so that every module builds its own, where a block's
    attention is not CCGQA or its parameters are not plain tensors: FSDP2 shards each block's
    parameters until that block runs."""
    from hydra_model.ccgqa import CCGQAAttention  # ccgqa imports this module

    if not attns or not all(isinstance(m, CCGQAAttention) for m in attns):
        return None
    params = [p for m in attns for p in (m.conv_seq.weight, m.conv_ch.weight)]
    if not all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params):
        return None
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(attns):
        groups.setdefault((fold_signature(m), m.conv_impl), []).append(i)
    out: list = [None] * len(attns)
    for (_, form), members in groups.items():
        for i, built in zip(members, fold_many([attns[i] for i in members], form), strict=True):
            out[i] = built
    return out


def _window_columns(weight: torch.Tensor) -> torch.Tensor:
    """The folded weight [L, C, C·K] (columns c·K + s) in a decode window's order (s·C + c)."""
    n, c, width = weight.shape
    k_total = width // c
    return weight.view(n, c, c, k_total).transpose(2, 3).reshape(n, c, width)


#: (the fold's shapes, device) → the window weight's tile layout (:func:`window_tile_layout`)
_LAYOUTS: dict[tuple, TileLayout] = {}


def window_tile_layout(module, device: torch.device) -> TileLayout:
    """The tiles of ``module``'s window weight (WINDOW_TILE) that may be non-zero whatever its
    conv parameters are: those of the fold of all-one conv weights and the q-k mean (a constant
    of the head counts), computed on the CPU once per shape and kept on ``device``. Packing with
    it reads nothing back from the GPU (the tiles' count from the values took a host read, the
    prefill's only one); a tile that is zero by value is kept, adding exact zeros."""
    seq, ch = module.conv_seq.weight, module.conv_ch.weight
    key = (tuple(seq.shape), tuple(ch.shape), module.n_heads, module.n_kv_heads, module.head_dim, device)
    layout = _LAYOUTS.get(key)
    if layout is None:
        from hydra_model.ccgqa import qk_mean_matrix  # ccgqa imports this module

        ones = (torch.ones(1, *seq.shape), torch.zeros(1, seq.shape[0]), torch.ones(1, *ch.shape),
                torch.zeros(1, ch.shape[0]))  # fmt: skip
        mix = qk_mean_matrix(module.n_heads, module.n_kv_heads, module.head_dim).abs().unsqueeze(0)
        weight = folded_qk_weight(*ones, mix)[0]  # [1, C, C·K], every coefficient ≥ 0: no cancelling
        nonzero = tile_nonzero(_window_columns(weight), *WINDOW_TILE)  # [NB, KB]
        layout = _LAYOUTS[key] = tile_layout(nonzero).to(device)
    return layout


def fold_signature(module) -> tuple:
    """What modules built together must share: their conv parameters' shapes, dtype and device,
    and their head counts (the joint temperature's layout)."""
    seq, ch = module.conv_seq.weight, module.conv_ch.weight
    heads = (module.n_heads, module.n_kv_heads, module.temperature.dtype)
    return tuple(seq.shape), tuple(ch.shape), seq.dtype, seq.device, module.qk_mean_mix.dtype, *heads


def conv_sources(module) -> tuple:
    """The tensors a module's bank entries are built from, by storage, shape, dtype and device."""
    tensors = (*conv_params(module), module.qk_mean_mix, module.temperature)
    return tuple((t.data_ptr(), t.shape, t.dtype, t.device) for t in tensors)


def fold_into_bank(bank, module, form: str) -> None:
    """Build ``form`` for ``module`` and, together with it, for every module of the bank's model
    that shares its signature and lacks the form (:class:`~hydra_model.cache.ConvBank`)."""
    sig = fold_signature(module)
    peers = [m for m in bank.modules if m is not module and (m, form) not in bank.weights]
    group = [module, *(m for m in peers if fold_signature(m) == sig)]
    for m, built in zip(group, fold_many(group, form), strict=True):
        bank.weights[(m, form)] = built
        bank.sources[(m, form)] = conv_sources(m)
