"""adamw_step_: AdamW's update over many tensors (Triton, interpreted on the CPU) against an
independent fp64 AdamW and against torch's fused AdamW, across launch groups and blocks; lr on
the device, the clip's grad_scale, a found_inf skip; gradients left as they were; β = 0 and many
lists (a plan each) against torch's own AdamW; what takes the reference; a first launch's failure
counted, a later one's raised; a capture on a GPU.

Inputs are fresh random each test (the ``seed`` fixture); the seed is in every failure message.
"""

import math
import re

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import adamw as aw
from hydra_kernels.ops.adamw import adamw_step_, adamw_step_ref_, kernel_takes

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON
HP = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 elements and groups of 3 tensors: several programs a tensor and several
    launches at test sizes."""
    monkeypatch.setattr(aw, "BLOCK", 64)
    monkeypatch.setattr(aw, "GROUP", 3)
    monkeypatch.setattr(aw, "_PLANS", {})


def _state(sizes, device=DEVICE):
    params = [torch.randn(n, device=device) for n in sizes]
    m = [torch.randn(n, device=device) * 1e-3 for n in sizes]
    v = [torch.rand(n, device=device) * 1e-6 for n in sizes]
    steps = [torch.tensor(float(s), device=device) for s in torch.randint(0, 20, (len(sizes),)).tolist()]
    return params, m, v, steps


def fp64_adamw(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay, scale=1.0):
    """Decoupled AdamW in float64, written out (step count t after its increment)."""
    g = g / scale
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return p - lr * m_hat / (v_hat.sqrt() + eps), m, v


@pytest.mark.parametrize("variant", ["float lr", "lr on device, grad_scale"])
def test_three_steps_equal_fp64_adamw(seed, small_blocks, variant):
    sizes = [1, 64, 65, 200, 7, 129, 3, 321]
    params, m, v, steps = _state(sizes)
    ref = [
        (p.double(), a.double(), b.double(), float(t)) for p, a, b, t in zip(params, m, v, steps, strict=True)
    ]
    on_device = variant != "float lr"
    lr = torch.tensor(3e-3, device=DEVICE) if on_device else 3e-3
    falls = controls.fallback_counts().get("adamw", 0)
    for _ in range(3):
        grads = [torch.randn(n, device=DEVICE) * 1e-2 for n in sizes]
        scale = torch.tensor(1.7, device=DEVICE) if on_device else None
        kept = [g.clone() for g in grads]
        assert kernel_takes(params, grads, m, v, steps)
        adamw_step_(params, grads, m, v, steps, lr=lr, grad_scale=scale, **HP)
        assert all(torch.equal(a, b) for a, b in zip(grads, kept, strict=True))  # gradients untouched
        ref = [(*fp64_adamw(p, g.double(), a, b, t + 1, 3e-3, scale=1.7 if on_device else 1.0, **HP), t + 1)
               for (p, a, b, t), g in zip(ref, grads, strict=True)]  # fmt: skip
    assert controls.fallback_counts().get("adamw", 0) == falls  # the kernel ran
    for i, (p, a, b, t) in enumerate(ref):
        assert float(steps[i]) == t
        # fp32 arithmetic: a few ulps of each value (the update itself is ~lr, far above them)
        torch.testing.assert_close(params[i].double(), p, rtol=2e-6, atol=1e-7, msg=f"seed {seed}")
        torch.testing.assert_close(m[i].double(), a, rtol=2e-6, atol=1e-9, msg=f"seed {seed}")
        torch.testing.assert_close(v[i].double(), b, rtol=4e-6, atol=1e-12, msg=f"seed {seed}")
    assert len(aw._PLANS) == 1 and len(next(iter(aw._PLANS.values())).groups) == 3


def test_found_inf_skips_the_update_and_the_count(seed):
    params, m, v, steps = _state([100, 5000])
    before = [t.clone() for t in (*params, *m, *v, *steps)]
    grads = [torch.randn_like(p) for p in params]
    falls = controls.fallback_counts().get("adamw", 0)
    for flag, changed in ((1.0, False), (0.0, True)):
        adamw_step_(params, grads, m, v, steps, lr=1e-3, found_inf=torch.tensor(flag, device=DEVICE), **HP)
        after = (*params, *m, *v, *steps)
        same = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert same != changed, f"seed {seed}: found_inf={flag}"
    assert [float(t) for t in steps] == [float(b) + 1 for b in before[-2:]]
    assert controls.fallback_counts().get("adamw", 0) == falls  # the kernel ran


def test_equals_torch_fused_adamw(seed):
    """Against torch's own fused AdamW (CPU or CUDA): five steps of a small model, lr 1e-2."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 9)).to(DEVICE)
    twin = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    m = [torch.zeros_like(p) for p in twin]
    v = [torch.zeros_like(p) for p in twin]
    steps = [torch.zeros((), device=DEVICE) for _ in twin]
    for _ in range(5):
        grads = [torch.randn_like(p) for p in twin]
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
        adamw_step_(twin, grads, m, v, steps, lr=1e-2, **HP)
    assert controls.fallback_counts().get("adamw", 0) == 0 or not kernel_takes(twin, grads, m, v, steps)
    for p, q in zip(model.parameters(), twin, strict=True):
        torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
    for p, mm, vv in zip(model.parameters(), m, v, strict=True):
        # torch's fused kernel forms the moments with fmas: an ulp or two of values up to ~1 apart
        torch.testing.assert_close(mm, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
        torch.testing.assert_close(vv, opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-6, msg=f"seed {seed}")


def test_what_takes_the_reference_and_bad_inputs():
    params, m, v, steps = _state([10, 20])
    grads = [torch.randn_like(p) for p in params]
    assert kernel_takes(params, grads, m, v, steps)
    assert not kernel_takes([p.double() for p in params], grads, m, v, steps)
    assert not kernel_takes(params, [g.half() for g in grads], m, v, steps)
    assert not kernel_takes([torch.randn(4, 5, device=DEVICE).t()], grads[:1], m[:1], v[:1], steps[:1])
    assert not kernel_takes([], [], [], [], [])
    controls.set_op_enabled("adamw", False)
    try:
        assert not kernel_takes(params, grads, m, v, steps)
    finally:
        controls.set_op_enabled("adamw", True)
    with pytest.raises(ValueError, match="different lengths"):
        adamw_step_(params, grads[:1], m, v, steps, lr=1e-3, **HP)
    with pytest.raises(ValueError, match="shape"):
        adamw_step_(params, grads[::-1], m, v, steps, lr=1e-3, **HP)


def test_the_reference_equals_fp64_adamw(seed):
    params, m, v, steps = _state([33, 7])
    p64 = [
        (p.double(), a.double(), b.double(), float(t) + 1)
        for p, a, b, t in zip(params, m, v, steps, strict=True)
    ]
    grads = [torch.randn_like(p) for p in params]
    adamw_step_ref_(params, grads, m, v, steps, lr=2e-3, grad_scale=torch.tensor(2.0, device=DEVICE), **HP)
    for i, (p, a, b, t) in enumerate(p64):
        want = fp64_adamw(p, grads[i].double(), a, b, t, 2e-3, scale=2.0, **HP)[0]
        torch.testing.assert_close(params[i].double(), want, rtol=2e-6, atol=1e-7, msg=f"seed {seed}")


@pytest.mark.fallback_expected
def test_a_first_launch_failure_is_counted_a_later_one_raised(monkeypatch, small_blocks):
    params, m, v, steps = _state([100, 100, 100, 100])  # two launches of 3 and 1 tensors
    grads = [torch.randn_like(p) for p in params]
    want = (
        [t.clone() for t in params],
        [t.clone() for t in m],
        [t.clone() for t in v],
        [t.clone() for t in steps],
    )
    adamw_step_ref_(*want[:1], [g.clone() for g in grads], *want[1:], lr=1e-3, **HP)
    real, calls = aw._adamw_kernel, []

    class Broken:
        arg_names = real.arg_names  # what a launch plan reads off a jitted function

        def __init__(self, fail_at):
            self.fail_at = fail_at

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                if len(calls) > self.fail_at:
                    raise RuntimeError("no kernel today")
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(aw, "_adamw_kernel", Broken(0))
    falls = controls.fallback_counts().get("adamw", 0)
    with pytest.warns(RuntimeWarning):
        adamw_step_(params, grads, m, v, steps, lr=1e-3, **HP)
    assert controls.fallback_counts()["adamw"] == falls + 1
    for got, exp in zip((params, m, v, steps), want, strict=True):
        for a, b in zip(got, exp, strict=True):
            torch.testing.assert_close(a, b)  # the reference's step, counted once
    calls.clear()
    monkeypatch.setattr(aw, "_adamw_kernel", Broken(1))
    with pytest.raises(RuntimeError, match="launch 1 failed"):
        adamw_step_(params, grads, m, v, steps, lr=1e-3, **HP)


def _torch_twin(params, groups, **hp):
    """torch.optim.AdamW's own (non-fused) step on fp64 CPU copies of ``params``, a param group
    each (``groups``) or one for all."""
    twin = [torch.nn.Parameter(p.double().cpu()) for p in params]
    spec = [{"params": [q]} for q in twin] if groups else twin
    return twin, torch.optim.AdamW(spec, foreach=False, **hp)


def _assert_equals_twin(params, m, v, twin, opt, seed):
    """The fp32 state against the fp64 twin's: a few ulps of values of the gradients' size (~1)."""
    for i, q in enumerate(twin):
        got, want = (params[i], m[i], v[i]), (q.detach(), opt.state[q]["exp_avg"], opt.state[q]["exp_avg_sq"])
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want, strict=True):
            msg = lambda text, name=name: f"seed {seed}, tensor {i}'s {name}: {text}"  # noqa: B023
            torch.testing.assert_close(a.double().cpu(), b, rtol=4e-6, atol=2e-7, msg=msg)


@pytest.mark.parametrize("face", ["kernel", "reference"])
@pytest.mark.parametrize("betas", [(0.0, 0.0), (0.0, 0.95), (0.9, 0.0)])
def test_zero_betas_equal_torch_adamw(seed, betas, face):
    """β = 0, which torch allows (0 ≤ β < 1): β^t = 0 from the first step on, as in torch's own
    AdamW (log2 0 raised a math domain error)."""
    hp = {"lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": 0.1}
    params = [torch.randn(n, device=DEVICE) for n in (5, 3000)]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    twin, opt = _torch_twin(params, False, **hp)
    step = adamw_step_ if face == "kernel" else adamw_step_ref_
    for _ in range(3):  # the first step (t = 1) included
        # |g| from 0.5 to 1.5: with β2 = 0 the update is m̂ / |g|, which would magnify fp32 rounding
        grads = [(torch.rand_like(p) + 0.5) * torch.randn_like(p).sign() for p in params]
        for q, g in zip(twin, grads, strict=True):
            q.grad = g.double().cpu()
        opt.step()
        assert kernel_takes(params, grads, m, v, steps)
        step(params, grads, m, v, steps, lr=1e-2, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=0.1)
    assert controls.fallback_counts().get("adamw", 0) == 0
    _assert_equals_twin(params, m, v, twin, opt, seed)


def test_many_param_groups_keep_their_plans(seed, monkeypatch):
    """70 one-tensor lists of distinct sizes, stepped a list at a time as hydra-train steps an
    optimizer's param groups: a plan each, more than the cache once held (it then dropped every
    plan, so each step rebuilt them all, a host-to-device copy each). The first step builds 70,
    later steps none; the result is torch's AdamW's."""
    monkeypatch.setattr(aw, "_PLANS", {})
    builds = []

    class Counted(aw.TensorGroups):
        def __init__(self, *args, **kwargs):
            builds.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(aw, "TensorGroups", Counted)
    params = [torch.randn(int(n) + 1, device=DEVICE) for n in torch.randperm(300)[:70]]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    twin, opt = _torch_twin(params, True, lr=1e-2, betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"])  # fmt: skip
    built = []
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for q, g in zip(twin, grads, strict=True):
            q.grad = g.double().cpu()
        opt.step()
        for i in range(len(params)):
            adamw_step_([params[i]], [grads[i]], [m[i]], [v[i]], [steps[i]], lr=1e-2, **HP)
        built.append(len(builds))
        builds.clear()
    assert built == [70, 0, 0] and len(aw._PLANS) == 70
    assert controls.fallback_counts().get("adamw", 0) == 0
    _assert_equals_twin(params, m, v, twin, opt, seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_step_replays_like_eager_steps(seed):
    sizes = [3, 70000, 8192]
    a, b = _state(sizes, "cuda"), None
    b = [[t.clone() for t in x] for x in a]
    lr = torch.tensor(1e-3, device="cuda")
    grads = [torch.randn(n, device="cuda") for n in sizes]
    adamw_step_(*a[:1], grads, *a[1:], lr=lr, **HP)  # the table, before capture
    adamw_step_(*b[:1], grads, *b[1:], lr=lr, **HP)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        adamw_step_(*a[:1], grads, *a[1:], lr=lr, **HP)
    for _ in range(2):
        for g in grads:
            g.normal_()
        graph.replay()
        adamw_step_(*b[:1], grads, *b[1:], lr=lr, **HP)
    torch.cuda.synchronize()
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            assert torch.equal(s, t), f"seed {seed}"


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    four = ("*fp32",) * 4
    build_sm90(
        aw._adamw_kernel,
        {
            "P": four,
            "G": four,
            "M": four,
            "V": four,
            "S": four,
            "TABLE": "*i64",
            "LR": "*fp32",
            "SCALE": "*fp32",
            "INF": "*fp32",
            "lr_value": "fp32",
            "log2_beta1": "fp32",
            "log2_beta2": "fp32",
            "beta1": "fp32",
            "beta2": "fp32",
            "eps": "fp32",
            "weight_decay": "fp32",
        },
        {"LR_ON_DEVICE": True, "HAS_SCALE": True, "HAS_INF": True, "NG": 4, "BLOCK": aw.BLOCK},
        aw.NUM_WARPS,
        1,
    )


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)


def test_log2_powers_match_pow():
    """β^t as exp2(t·log2 β): within fp32 rounding of the direct power over a run's steps."""
    t = torch.arange(1, 100001, dtype=torch.float64)
    for beta in (0.9, 0.95, 0.999):
        approx = 1 - torch.exp2(t.float() * math.log2(beta)).double()
        exact = 1 - beta**t
        # 1 − β^t in fp32 (torch's fused AdamW too) is off by up to an ulp of 1 where β^t ≈ 1
        assert float((approx - exact).abs().max()) <= 2 * torch.finfo(torch.float32).eps


# --- tensors of the call on other devices ---------------------------------------------------------
# One launch reads every pointer on the parameters' device. Before the device checks a scalar tensor
# elsewhere made the first launch fail (a counted fallback) and the reference then failed with
# torch's unnamed device error, or (a plan already compiled, on a GPU) was read through a pointer
# of another device; a list's tensor elsewhere took the reference silently.


def _call_with(where: str, device: str):
    """adamw_step_'s arguments with the one named by ``where`` (a scalar, or entry 1 of a list) on
    ``device``: lr, grad_scale and found_inf tensors on the parameters' device otherwise."""
    params, m, v, steps = _state([10, 20])
    lists = {"params": params, "grads": [torch.randn_like(p) for p in params], "exp_avgs": m,
             "exp_avg_sqs": v, "steps": steps}  # fmt: skip
    scalars = {"lr": torch.tensor(1e-3, device=DEVICE), "grad_scale": torch.tensor(2.0, device=DEVICE),
               "found_inf": torch.tensor(0.0, device=DEVICE)}  # fmt: skip
    if where in scalars:
        scalars[where] = scalars[where].to(device)
    else:
        name = where.split("[")[0]
        lists[name][1] = torch.empty_like(lists[name][1], device=device)
    return list(lists.values()), scalars


_SCALARS = ["lr", "grad_scale", "found_inf"]
# adamw_kernel_step_'s caller (hydra-train's step) has asked kernel_takes, which checks the lists
_ELSEWHERE = [("adamw_step_", w) for w in [*_SCALARS, "grads[1]", "exp_avg_sqs[1]", "steps[1]"]] + [
    ("adamw_kernel_step_", w) for w in _SCALARS
]


@pytest.mark.parametrize(("entry", "where"), _ELSEWHERE)
def test_a_tensor_on_another_device_is_named(entry, where):
    step = getattr(aw, entry)
    lists, scalars = _call_with(where, DEVICE.type)
    step(*lists, **scalars, **HP)  # on one device it runs
    lists, scalars = _call_with(where, "meta")
    label = re.escape(where)
    with pytest.raises(
        ValueError, match=rf"adamw_step_: {label} .* is on meta but params\[0\] is on {DEVICE.type}"
    ):
        step(*lists, **scalars, **HP)
    assert controls.fallback_counts().get("adamw", 0) == 0


def test_a_cpu_lr_in_a_capture_is_refused(monkeypatch):
    """A CPU lr beside parameters elsewhere is read on the host, as torch's fused AdamW reads it:
    inside a CUDA graph capture that would fix its value into the graph (a schedule's later values
    never replayed), so it is refused there. Meta-device parameters stand in for a GPU's (their
    step is the reference's, on no data) and the capture is pretended."""
    params, m, v, steps = _state([10, 20], "meta")
    grads = [torch.empty_like(p) for p in params]
    monkeypatch.setattr(aw._tensor_groups, "capturing", lambda device: True)
    with pytest.raises(ValueError, match=r"adamw_step_: lr is a CPU tensor .* capture"):
        adamw_step_(params, grads, m, v, steps, lr=torch.tensor(1e-3), **HP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CPU lr beside CUDA parameters needs a GPU")
def test_a_cpu_lr_steps_as_its_value(seed):
    """lr as a CPU tensor beside CUDA parameters: torch's fused AdamW reads it as a number
    (torch/optim/adam.py's _fused_adam); so does adamw_step_, by the kernel, with no fallback,
    at the first call and at later ones (a compiled launch plan)."""
    a = _state([70, 3000], "cuda")
    b = [[t.clone() for t in x] for x in a]
    for _ in range(2):
        grads = [torch.randn_like(p) for p in a[0]]
        adamw_step_(*a[:1], grads, *a[1:], lr=torch.tensor(3e-3), **HP)
        adamw_step_(*b[:1], grads, *b[1:], lr=3e-3, **HP)
    assert controls.fallback_counts().get("adamw", 0) == 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            assert torch.equal(s, t), f"seed {seed}"
