"""Gradient clipping folded into fused AdamW's step (hydra_train.optim.clip_and_step / step_with):
against an fp64 AdamW written out by hand on the clipped gradients, against clip_grad_norm_ then
the same fused step, and the trainer's step against the same hand-written reference. CUDA too,
where present (the fused kernel there is another implementation)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from hydra_train.optim import (
    build_optimizer,
    clip_and_step,
    clip_divisor,
    folds_grad_clip,
    kernel_step_groups,
    step_with,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LR, BETAS, EPS, WD = 3e-2, (0.9, 0.95), 1e-8, 0.1


def _model(seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 5)
    return torch.nn.Sequential(*layers).to(device)


def _set_grads(model: torch.nn.Module, gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
        p.grad = g.to(p.device, p.dtype)
        grads.append(g)
    return grads


def _adamw_fp64(params, grads_per_step, max_norm, decays):
    """AdamW on fp64 copies, the gradients clipped as clip_grad_norm_ defines it."""
    p = [q.detach().double().cpu().clone() for q in params]
    m = [torch.zeros_like(q) for q in p]
    v = [torch.zeros_like(q) for q in p]
    for t, grads in enumerate(grads_per_step, start=1):
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        for i, g in enumerate(grads):
            g = g * coef
            p[i] *= 1 - LR * decays[i]
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            mhat, vhat = m[i] / (1 - BETAS[0] ** t), v[i] / (1 - BETAS[1] ** t)
            p[i] -= LR * mhat / (vhat.sqrt() + EPS)
    return p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [3.0, 0.01])  # norm far above max_norm (clipped), and below it
def test_clip_and_step_equals_clipping_then_stepping(device, scale):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    folded, unfolded = _model(seed, device), _model(seed, device)
    start = [p.detach().clone() for p in folded.parameters()]
    opts = [build_optimizer(m, lr=LR, weight_decay=WD, betas=BETAS).optimizer for m in (folded, unfolded)]
    assert all(folds_grad_clip(o) for o in opts)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(3):
        grads = _set_grads(folded, gen, scale)
        history.append(grads)
        for p, q in zip(folded.parameters(), unfolded.parameters(), strict=True):
            q.grad = p.grad.clone()
        by_kernel = kernel_step_groups(opts[0]) is not None  # hydra_kernels' AdamW (after step 1)
        unclipped = [p.grad.clone() for p in folded.parameters()]
        clip_and_step(opts[0], list(folded.parameters()), 1.0)
        torch.nn.utils.clip_grad_norm_(list(unfolded.parameters()), 1.0)
        for p, q, g in zip(folded.parameters(), unfolded.parameters(), unclipped, strict=True):
            if by_kernel:  # hydra_kernels' AdamW leaves the gradients as they were
                assert torch.equal(p.grad, g)
            else:  # torch's fused kernel writes the clipped gradient back, as the multiply would have
                torch.testing.assert_close(p.grad, q.grad, rtol=3e-7, atol=0)
        opts[1].step()
        assert getattr(opts[0], "grad_scale", None) is None and getattr(opts[0], "found_inf", None) is None
    decays = [WD if p.ndim >= 2 else 0.0 for p in folded.parameters()]
    want = _adamw_fp64(start, history, 1.0, decays)
    for p, q, w in zip(folded.parameters(), unfolded.parameters(), want, strict=True):
        if scale < 1 and not _kernel_path(device):  # nothing clipped: divisor 1, one kernel rounds alike
            assert torch.equal(p, q)
        torch.testing.assert_close(p.detach().double().cpu(), w, rtol=0, atol=2e-6)
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)


def _kernel_path(device: str = "cpu") -> bool:
    """Whether hydra_kernels' AdamW kernel steps an optimizer on ``device`` here (CUDA, or the
    CPU under the Triton interpreter)."""
    from hydra_kernels import controls

    return controls.triton_path("adamw", torch.zeros(1, device=device))


def test_clip_divisor_is_the_inverse_of_clip_grad_norms_factor():
    norms = torch.cat([torch.rand(25, dtype=torch.float64) * 4, torch.rand(25, dtype=torch.float64) * 1e-3])
    for norm in norms:
        factor = min(1.0, 2.0 / (float(norm) + 1e-6))
        assert float(clip_divisor(norm, 2.0)) == pytest.approx(1.0 / factor, rel=1e-7)
    assert float(clip_divisor(torch.tensor(float("inf")), 1.0)) == float("inf")


def test_step_with_found_inf_skips_and_leaves_the_gradients():
    model = _model(3, "cpu")
    opt = build_optimizer(model, lr=LR, weight_decay=WD, betas=BETAS).optimizer
    gen = torch.Generator().manual_seed(5)
    _set_grads(model, gen, 2.0)
    opt.step()
    before = copy.deepcopy(model.state_dict())
    _set_grads(model, gen, 2.0)
    grads = [p.grad.clone() for p in model.parameters()]
    step_with(opt, torch.tensor(7.0), torch.ones(()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    assert getattr(opt, "grad_scale", None) is None and getattr(opt, "found_inf", None) is None
    assert (kernel_step_groups(opt) is not None) == _kernel_path()


def test_step_with_refuses_an_optimizer_that_cannot_take_the_divisor():
    model = _model(0, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    assert not folds_grad_clip(opt)
    with pytest.raises(TypeError, match=r"AdamW.*takes no grad_scale"):
        step_with(opt, torch.tensor(2.0))
    # clip_and_step clips such an optimizer's gradients itself
    _set_grads(model, torch.Generator().manual_seed(1), 5.0)
    clip_and_step(opt, list(model.parameters()), 1.0)
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    assert float(norm) == pytest.approx(1.0, rel=1e-5)


def test_step_with_clears_its_inputs_when_the_step_raises(monkeypatch):
    model = _model(0, "cpu")
    opt = build_optimizer(model, lr=LR, weight_decay=WD, betas=BETAS).optimizer

    def boom(*args, **kwargs):
        raise RuntimeError("step failed")

    monkeypatch.setattr(opt, "step", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        step_with(opt, torch.tensor(2.0), torch.zeros(()))
    assert opt.grad_scale is None and opt.found_inf is None


def test_the_trainers_clipped_step_equals_clipping_then_stepping(bin_dataset, tmp_path, monkeypatch):
    """hydra-train's step (fused AdamW on the CPU, the clip folded in) against the same run with
    the fold switched off (clip_grad_norm_, then the step): the same losses and weights to fp32
    rounding, with the clip active in every step."""
    from hydra_train import optim as optim_module
    from hydra_train import step as step_module
    from hydra_train.callbacks import TrainerCallback
    from hydra_train.run import run_training

    from .conftest import tiny_config

    class Norms(TrainerCallback):
        name = "norms"

        def __init__(self):
            self.losses, self.norms = {}, {}

        def on_step_end(self, step, metrics):
            f = metrics.as_floats()
            self.losses[step], self.norms[step] = f["loss"], f["grad_norm"]

    runs = {}
    for folded in (True, False):
        if not folded:  # where the step asks (its norm in optim, its found_inf skip in step)
            for module in (step_module, optim_module):
                monkeypatch.setattr(module, "folds_grad_clip", lambda opt: False)
        rec = Norms()
        run_training(
            tiny_config(bin_dataset, tmp_path / str(folded), max_steps=4, log_every=1, grad_clip=0.05),
            callbacks=[rec],
        )
        final = torch.load(tmp_path / str(folded) / "hydra_tiny_final.pt", weights_only=True)["model"]
        runs[folded] = (rec, final)
    (rec_a, model_a), (rec_b, model_b) = runs[True], runs[False]
    assert all(n > 0.05 for n in rec_a.norms.values())  # every step clipped
    for step in range(1, 5):
        assert rec_a.losses[step] == pytest.approx(rec_b.losses[step], rel=1e-5)
        assert rec_a.norms[step] == pytest.approx(rec_b.norms[step], rel=1e-4)
    for k in model_a:
        torch.testing.assert_close(model_a[k], model_b[k], rtol=0, atol=1e-5)


def test_which_optimizers_the_adamw_kernel_steps():
    """kernel_step_groups: a fused AdamW whose state is built, without amsgrad or step hooks; one
    entry a param group with gradients, the lists in the group's order."""
    from hydra_kernels import controls

    controls.set_use_triton_kernels(True)  # a module- or session-scoped fixture may have left them off
    if not _kernel_path():
        pytest.skip("hydra_kernels' AdamW runs on the CPU only under the Triton interpreter")
    model = _model(2, "cpu")
    opt = build_optimizer(model, lr=LR, weight_decay=WD, betas=BETAS).optimizer
    _set_grads(model, torch.Generator().manual_seed(2), 1.0)
    assert kernel_step_groups(opt) is None  # no state yet: torch's first step builds it
    opt.step()
    groups = kernel_step_groups(opt)
    assert [g for g, _ in groups] == opt.param_groups
    for group, (params, grads, m, v, steps) in groups:
        assert params == list(group["params"])
        assert all(g is p.grad for p, g in zip(params, grads, strict=True))
        for p, mm, vv, t in zip(params, m, v, steps, strict=True):
            st = opt.state[p]
            assert mm is st["exp_avg"] and vv is st["exp_avg_sq"] and t is st["step"]
    handle = opt.register_step_pre_hook(lambda *a: None)
    assert kernel_step_groups(opt) is None  # hooks: torch's step runs them
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda *a: None)
    assert kernel_step_groups(opt) is None  # every optimizer's hooks too
    handle.remove()
    opt.param_groups[0]["amsgrad"] = True
    assert kernel_step_groups(opt) is None
    opt.param_groups[0]["amsgrad"] = False
    assert kernel_step_groups(opt) is not None
    plain = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    plain.step()
    assert kernel_step_groups(plain) is None  # not fused
    for p in model.parameters():
        p.grad = None
    assert kernel_step_groups(opt) is None  # nothing to step


def test_a_torch_scheduler_after_a_kernel_step_does_not_warn():
    """A run resumed with its optimizer state: its first step is the AdamW kernel's, not
    ``opt.step()``; a torch lr_scheduler built before it must not warn that it stepped first."""
    import warnings

    from hydra_kernels import controls

    controls.set_use_triton_kernels(True)  # as in the test above
    if not _kernel_path():
        pytest.skip("hydra_kernels' AdamW runs on the CPU only under the Triton interpreter")
    model = _model(2, "cpu")
    opt = build_optimizer(model, lr=LR, weight_decay=WD, betas=BETAS).optimizer
    _set_grads(model, torch.Generator().manual_seed(3), 1.0)
    opt.step()  # the state a checkpoint would restore
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    assert kernel_step_groups(opt) is not None
    step_with(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()


def _count_kernel_steps(monkeypatch) -> list:
    """Each call of hydra_kernels' AdamW kernel from step_with (one a param group), recorded."""
    from hydra_train import optim as optim_module

    calls, real = [], optim_module.adamw_kernel_step_

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(optim_module, "adamw_kernel_step_", counted)
    return calls


def test_step_with_runs_an_instance_step_override(monkeypatch):
    """A wrapper set on the instance (``opt.step = wrapper``: EMA, logging, accelerate) runs once a
    step_with, through torch's step; torch's lr_scheduler wrapper of the class's own step leaves
    the step to the kernel (it records only that the step ran, which step_with records too)."""
    from hydra_kernels import controls

    controls.set_use_triton_kernels(True)  # as in the tests above
    if not _kernel_path():
        pytest.skip("hydra_kernels' AdamW runs on the CPU only under the Triton interpreter")
    kernel = _count_kernel_steps(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    model = _model(4, "cpu")
    opts = [build_optimizer(model, lr=LR, weight_decay=WD, betas=BETAS).optimizer for _ in range(3)]
    _set_grads(model, gen, 1.0)
    for opt in opts:
        opt.step()  # the state: the kernel could step each from here
    wrapped, calls = opts[0].step, []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return wrapped(*args, **kwargs)

    opts[0].step = wrapper
    # a scheduler wrapping an override (a bound method of the user's) wraps that override
    opts[1].step = types.MethodType(lambda self, *a, **k: wrapper(*a, **k), opts[1])
    torch.optim.lr_scheduler.LambdaLR(opts[1], lambda step: 1.0)
    for n, opt in enumerate(opts[:2], start=1):
        before = [p.detach().clone() for p in model.parameters()]
        step_with(opt, torch.tensor(2.0), torch.zeros(()))
        assert len(calls) == n and not kernel
        assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    torch.optim.lr_scheduler.LambdaLR(opts[2], lambda step: 1.0)  # wraps the class's step
    step_with(opts[2])
    assert len(kernel) == len(opts[2].param_groups) and len(calls) == 2 and opts[2]._opt_called


def test_a_capture_without_the_kernels_plans_captures_torchs_step(monkeypatch):
    """A CUDA graph capture whose warm-up step was the optimizer's first (torch's, as no state
    existed): the kernel has no launch plan, and a plan cannot be built inside a capture, so
    step_with captures torch's fused step; once the plans exist, the kernel's. The capture is
    simulated on the CPU (the GPU one: test_a_captured_step_with_replays_like_eager_steps)."""
    from hydra_kernels import controls
    from hydra_kernels.ops import _tensor_groups, adamw

    controls.set_use_triton_kernels(True)
    if not _kernel_path():
        pytest.skip("hydra_kernels' AdamW runs on the CPU only under the Triton interpreter")
    monkeypatch.setattr(adamw, "_PLANS", {})  # none built yet
    kernel = _count_kernel_steps(monkeypatch)
    model, twin = _model(5, "cpu"), _model(5, "cpu")
    opt, twin_opt = (build_optimizer(m, lr=LR, weight_decay=WD, betas=BETAS).optimizer for m in (model, twin))
    gen = torch.Generator().manual_seed(5)
    # the warm-up (torch's first step), the capture, an eager kernel step, another capture
    for capturing, kernel_steps in ((False, 0), (True, 0), (False, 2), (True, 4)):
        monkeypatch.setattr(_tensor_groups, "capturing", lambda device, on=capturing: on)
        _set_grads(model, gen, 1.0)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.grad = p.grad.clone()
        step_with(opt)
        twin_opt.step()
        assert len(kernel) == kernel_steps, f"capturing={capturing}"
    assert len(adamw._PLANS) == 2 and all(plan.captured for plan in adamw._PLANS.values())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("groups", [2, 70])
@pytest.mark.parametrize("eager_steps", [1, 2])
def test_a_captured_step_with_replays_like_eager_steps(monkeypatch, eager_steps, groups):
    """step_with captured in a CUDA graph after eager steps (the first torch's, building the state;
    the second the kernel's, building its launch plans), replayed, against an eager twin. After
    one eager step torch's fused step is captured; after two, the kernel's, for 70 param groups
    too (a plan each: more than the plan cache once kept)."""
    from hydra_kernels.ops import adamw
    from hydra_train.graphed_step import make_capturable

    monkeypatch.setattr(adamw, "_PLANS", {})  # none built before the eager steps
    kernel = _count_kernel_steps(monkeypatch)
    sizes = (torch.randperm(5000)[:groups] + 1).tolist()
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = []
    for ps in (params, twins):
        spec = [{"params": [p], "weight_decay": WD * (i % 2)} for i, p in enumerate(ps)]
        opts.append(torch.optim.AdamW(spec, lr=LR, betas=BETAS, eps=EPS, fused=True))
        make_capturable(opts[-1], torch.device("cuda"))
    grads = [torch.zeros_like(p) for p in params]  # the graph reads these buffers
    divisor, skip = torch.tensor(1.5, device="cuda"), torch.zeros((), device="cuda")

    def step() -> None:  # new gradients, the twin's step (the graphed optimizer's follows)
        for p, q, g in zip(params, twins, grads, strict=True):
            g.normal_()
            p.grad, q.grad = g, g.clone()
        step_with(opts[1], divisor, skip)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager steps on a side stream, as before any capture
        for _ in range(eager_steps):
            step()
            step_with(opts[0], divisor, skip)
    torch.cuda.current_stream().wait_stream(side)
    before, graph = len(kernel), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_with(opts[0], divisor, skip)
    assert (len(kernel) > before) == (eager_steps > 1)
    for _ in range(3):
        step()
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)
