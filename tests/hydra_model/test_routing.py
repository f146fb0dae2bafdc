"""Routing primitives against loops over Python lists."""

from __future__ import annotations

import torch

from hydra_model.routing import (
    SubSequence,
    gather_tokens,
    membership_bce,
    scatter_add_tokens,
    selected_first,
    topk_in_time_order,
)


def test_gather_and_scatter_add_match_loops():
    torch.manual_seed(0)
    h = torch.randn(3, 11, 5)
    idx = torch.stack([torch.randperm(11)[:4] for _ in range(3)])
    got = gather_tokens(h, idx)
    for b in range(3):
        for j in range(4):
            assert torch.equal(got[b, j], h[b, idx[b, j]])
    upd = torch.randn(3, 4, 5)
    out = scatter_add_tokens(h, idx, upd)
    ref = h.clone()
    for b in range(3):
        for j in range(4):
            ref[b, idx[b, j]] += upd[b, j]
    torch.testing.assert_close(out, ref)


def test_topk_in_time_order():
    scores = torch.tensor([[0.1, 0.9, -1.0, 0.5, 0.7, 0.0, 2.0]])
    assert topk_in_time_order(scores, 3).tolist() == [[1, 4, 6]]
    assert topk_in_time_order(scores, 7).tolist() == [list(range(7))]


def test_selected_first_keeps_time_order_and_marks_the_prefix():
    g = torch.Generator().manual_seed(3)
    sel = torch.rand(4, 13, generator=g) > 0.5
    sel[0] = False  # nothing selected
    sel[1] = True  # everything selected
    perm, member = selected_first(sel)
    for b in range(4):
        chosen = [t for t in range(13) if sel[b, t]]
        rest = [t for t in range(13) if not sel[b, t]]
        assert perm[b].tolist() == chosen + rest
        assert member[b].tolist() == [True] * len(chosen) + [False] * len(rest)


def test_subsequence_scatter_only_touches_members():
    h = torch.zeros(1, 5, 2)
    sel = torch.tensor([[False, True, False, True, False]])
    view = SubSequence.permuted(sel, torch.arange(5).view(1, 5) + 100)
    assert view.pos.tolist() == [[101, 103, 100, 102, 104]]
    upd = torch.arange(10, dtype=torch.float32).view(1, 5, 2) + 1
    out = view.scatter_add(h, upd)
    assert out[0, :, 0].tolist() == [0.0, 1.0, 0.0, 3.0, 0.0]
    topk = SubSequence.top_k(torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0]]), 2, torch.arange(5).view(1, 5))
    assert topk.idx.tolist() == [[1, 3]] and topk.member is None


def test_membership_bce_averages_over_candidates_only():
    logits = torch.tensor([[0.0, 2.0, -1.0]])
    target = torch.tensor([[True, False, True]])
    cand = torch.tensor([[True, True, False]])
    expected = (torch.log(torch.tensor(2.0)) + torch.nn.functional.softplus(torch.tensor(2.0))) / 2
    torch.testing.assert_close(membership_bce(logits, target, cand), expected)


def test_gather_rows_backward_is_a_plain_scatter_and_gradchecks():
    from hydra_model.routing import gather_rows

    g = torch.Generator().manual_seed(2)
    src = torch.randn(13, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randperm(13, generator=g)[:6]
    torch.autograd.gradcheck(gather_rows, (src, idx))
    out = gather_rows(src, idx)
    assert torch.equal(out, src.detach()[idx])
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    ref = torch.zeros_like(src)
    for j, i in enumerate(idx.tolist()):
        ref[i] += grad[j]
    assert torch.equal(src.grad, ref)


def test_gather_rows_under_compile_is_the_custom_op_with_the_same_values_and_gradient():
    """Traced, gather_rows is the hydra_model::gather_rows op (an autograd.Function in a graph
    makes torch skip its AOTAutograd cache): the same rows, the same plain-scatter gradient."""
    from hydra_model.routing import gather_rows

    g = torch.Generator().manual_seed(4)
    src = torch.randn(17, 6, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randperm(17, generator=g)[:7]
    grad = torch.randn(7, 6, generator=g, dtype=torch.float64)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(gather_rows, backend=backend, fullgraph=True)
    out = compiled(src, idx)
    assert torch.equal(out, src.detach()[idx])
    out.backward(grad)
    ref = torch.zeros_like(src)
    for j, i in enumerate(idx.tolist()):
        ref[i] += grad[j]
    assert torch.equal(src.grad, ref)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "hydra_model.gather_rows.default" in targets
    torch.autograd.gradcheck(torch.compile(gather_rows, backend="aot_eager", fullgraph=True), (src, idx))


def test_masked_means_with_known_count_and_per_channel():
    from hydra_model.routing import masked_mean, masked_mean_last

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 7, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.4
    ref = x[mask].mean()
    torch.testing.assert_close(masked_mean(x, mask), ref)
    torch.testing.assert_close(masked_mean(x, mask, int(mask.sum())), ref)
    y = torch.randn(3, 7, 4, generator=g)
    torch.testing.assert_close(masked_mean_last(y, mask), y[mask].mean(0))
    torch.testing.assert_close(masked_mean_last(y, None), y.reshape(-1, 4).mean(0))
