"""8-bit Adam state conversion: the blockwise quantiser against a brute-force fp64 nearest code,
and the bitsandbytes-layout state -> torch AdamW mapping. (bitsandbytes' 8-bit optimizers need
CUDA: on the CPU the optimization is N/A; ``packages/hydra-diag/bench/safe_opts_gpu_checks.py``
checks this quantiser against bitsandbytes' own, bit for bit, and the torch -> 8-bit -> torch round trip.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hydra_train.config import TrainConfig
from hydra_train.safe_opts.adam8bit import (
    BLOCK,
    EightBitAdam,
    adamw_state_from_8bit,
    dequantize_blockwise,
    quantize_blockwise,
    to_torch_adamw,
)


def code_table(signed: bool) -> torch.Tensor:
    """A non-uniform 256-entry table in a shuffled order, like a dynamic map (values in [-1, 1])."""
    g = torch.Generator().manual_seed(0)
    mags = torch.linspace(0, 1, 128 if signed else 256) ** 3
    vals = torch.cat([mags, -mags[1:], torch.tensor([1.0])]) if signed else mags
    return vals[torch.randperm(256, generator=g)]


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(1000,), (7, 143)])
def test_quantize_is_the_nearest_code_per_block(signed, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 5
    x = x if signed else x.abs()
    code = code_table(signed)
    q, absmax = quantize_blockwise(x, code)
    flat = x.reshape(-1).double()
    n_blocks = (flat.numel() + BLOCK - 1) // BLOCK
    assert q.dtype == torch.uint8 and q.numel() == flat.numel() and absmax.shape == (n_blocks,)
    ref_absmax = torch.stack([flat[i * BLOCK : (i + 1) * BLOCK].abs().max() for i in range(n_blocks)])
    assert torch.allclose(absmax.double(), ref_absmax, rtol=0, atol=0)
    normed = flat / ref_absmax.repeat_interleave(BLOCK)[: flat.numel()]
    brute = code.double()[(normed.unsqueeze(1) - code.double().unsqueeze(0)).abs().argmin(dim=1)]
    got = code.double()[q.long()]
    # the same code value as the exhaustive search (ties between two codes may go either way)
    dist_got = (got - normed).abs()
    dist_brute = (brute - normed).abs()
    assert torch.all(dist_got <= dist_brute + 1e-7)
    back = dequantize_blockwise(q.view(shape), code, absmax)
    assert back.shape == x.shape
    assert torch.equal(back.reshape(-1), (code[q.long()] * absmax.repeat_interleave(BLOCK)[: flat.numel()]))


def fake_8bit_optimizer(params, moments):
    """An object with bitsandbytes AdamW8bit's state layout (keys and block size as in 0.50)."""
    codes = {1: code_table(True), 2: code_table(False)}
    state = {}
    for p, (m, v, step) in zip(params, moments, strict=True):
        if p.numel() < 4096:  # bitsandbytes keeps small tensors' states in 32 bits
            state[p] = {"step": step, "state1": m.clone(), "state2": v.clone()}
            continue
        s = {"step": step}
        for i, t in ((1, m), (2, v)):
            q, a = quantize_blockwise(t, codes[i])
            s.update({f"state{i}": q.view_as(p), f"qmap{i}": codes[i], f"absmax{i}": a})
        state[p] = s
    groups = [
        {
            "params": params,
            "lr": 2e-3,
            "betas": (0.8, 0.9),
            "eps": 1e-7,
            "weight_decay": 0.05,
            "initial_lr": 3e-3,
        }
    ]
    return SimpleNamespace(param_groups=groups, state=state), codes


def two_params_and_moments(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor, list, torch.Generator]:
    """A matrix large enough for 8-bit blockwise state and a small vector (kept in 32 bits), with
    moments (exp_avg, exp_avg_sq, step) for each, and the generator that drew them."""
    g = torch.Generator().manual_seed(seed)
    big, small = torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(30))
    moments = [
        (torch.randn(64, 80, generator=g) * 1e-3, torch.rand(64, 80, generator=g) * 1e-6, step),
        (torch.randn(30, generator=g), torch.rand(30, generator=g), step),
    ]
    return big, small, moments, g


def test_8bit_state_to_torch_adamw():
    big, small, moments, g = two_params_and_moments(2, 7)
    opt8, codes = fake_8bit_optimizer([big, small], moments)
    new = to_torch_adamw(opt8, fused=True)
    g0 = new.param_groups[0]
    assert (g0["lr"], g0["betas"], g0["eps"], g0["weight_decay"], g0["initial_lr"]) == (
        2e-3,
        (0.8, 0.9),
        1e-7,
        0.05,
        3e-3,
    )
    s_big, s_small = new.state[big], new.state[small]
    assert float(s_big["step"]) == 7.0 and s_big["step"].dtype == torch.float32
    expect = dequantize_blockwise(opt8.state[big]["state1"], codes[1], opt8.state[big]["absmax1"])
    assert torch.equal(s_big["exp_avg"], expect)  # dequantisation, exact
    assert torch.equal(s_small["exp_avg"], moments[1][0]) and torch.equal(
        s_small["exp_avg_sq"], moments[1][1]
    )
    # the rebuilt optimizer steps from those moments exactly like a torch AdamW given them by hand
    ref = torch.optim.AdamW(
        [p.detach().clone().requires_grad_() for p in (big, small)],
        lr=2e-3,
        betas=(0.8, 0.9),
        eps=1e-7,
        weight_decay=0.05,
        fused=True,
    )
    for rp, p in zip(ref.param_groups[0]["params"], (big, small), strict=True):
        ref.state[rp] = {k: v.clone() for k, v in new.state[p].items()}
        rp.grad = p.grad = torch.randn(p.shape, generator=g)
    new.step()
    ref.step()
    for rp, p in zip(ref.param_groups[0]["params"], (big, small), strict=True):
        assert torch.equal(rp, p)
    assert adamw_state_from_8bit(opt8, torch.device("cpu"))[big]["exp_avg"].device.type == "cpu"


def test_not_applicable_on_cpu():
    tr = SimpleNamespace(device=torch.device("cpu"))
    assert "CUDA" in EightBitAdam(TrainConfig(eight_bit_adam=True)).not_applicable(tr)


def bnb_checkpoint_state(params, moments) -> tuple[dict, dict]:
    """``optimizer.state_dict()`` of a bitsandbytes AdamW8bit (what ``hydra-train run --8bit_adam``
    saved before checkpoints held torch-format state), and the moments it encodes, recomputed here
    as code[q] · absmax by hand."""
    opt8, codes = fake_8bit_optimizer(params, moments)
    state, want = {}, {}
    for i, p in enumerate(params):
        s = opt8.state[p]
        state[i] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        if s["state1"].dtype == torch.uint8:
            scale = {j: s[f"absmax{j}"].repeat_interleave(BLOCK)[: p.numel()] for j in (1, 2)}
            m, v = (codes[j][s[f"state{j}"].reshape(-1).long()] * scale[j] for j in (1, 2))
            want[i] = (m.view_as(p), v.view_as(p))
        else:
            want[i] = (s["state1"], s["state2"])
    group = {k: v for k, v in opt8.param_groups[0].items() if k != "params"}
    # bitsandbytes' own group settings, which torch's AdamW has no use for
    group.update(optim_bits=32, min_8bit_size=4096, percentile_clipping=100, block_wise=True)
    return {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}, want


def test_a_saved_8bit_state_loads_into_torch_adamw_without_bitsandbytes():
    """Loaded as it is, torch's AdamW took it and failed at the first step (KeyError: 'exp_avg'),
    having also dropped ``fused``; converted, it continues from the same moments."""
    from hydra_train.safe_opts.adam8bit import adamw_state_dict_from_8bit, is_8bit_state_dict

    big, small, moments, g = two_params_and_moments(3, 11)
    saved, want = bnb_checkpoint_state([big, small], moments)
    assert is_8bit_state_dict(saved)
    opt = torch.optim.AdamW([big, small], lr=1e-4, fused=True)
    assert not is_8bit_state_dict(opt.state_dict())
    converted, n = adamw_state_dict_from_8bit(saved, opt)
    assert n == 2
    opt.load_state_dict(converted)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        2e-3,
        (0.8, 0.9),
        1e-7,
        0.05,
    )
    assert group["fused"] is True and "optim_bits" not in group
    for i, p in enumerate((big, small)):
        st = opt.state[p]
        assert float(st["step"]) == 11.0
        assert torch.equal(st["exp_avg"], want[i][0]) and torch.equal(st["exp_avg_sq"], want[i][1])
    # it steps as a torch AdamW given those moments by hand
    ref = torch.optim.AdamW(
        [p.detach().clone().requires_grad_() for p in (big, small)],
        lr=2e-3,
        betas=(0.8, 0.9),
        eps=1e-7,
        weight_decay=0.05,
    )
    for i, (rp, p) in enumerate(zip(ref.param_groups[0]["params"], (big, small), strict=True)):
        ref.state[rp] = {
            "step": torch.tensor(11.0),
            "exp_avg": want[i][0].clone(),
            "exp_avg_sq": want[i][1].clone(),
        }
        rp.grad = p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    ref.step()
    for rp, p in zip(ref.param_groups[0]["params"], (big, small), strict=True):
        torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-7)


def test_an_8bit_state_without_its_block_scales_is_one_clear_error():
    from hydra_train.errors import HydraCheckpointError
    from hydra_train.safe_opts.adam8bit import adamw_state_dict_from_8bit

    big = torch.nn.Parameter(torch.randn(64, 80))
    saved, _ = bnb_checkpoint_state([big], [(torch.randn(64, 80), torch.rand(64, 80), 2)])
    del saved["state"][0]["absmax1"]  # e.g. a non-blockwise 8-bit state (max1 instead)
    with pytest.raises(HydraCheckpointError, match="absmax1"):
        adamw_state_dict_from_8bit(saved, torch.optim.AdamW([big]))


def test_a_resume_from_an_8bit_checkpoint_continues_as_the_uninterrupted_run(bin_dataset, tmp_path):
    """hydra-train run --resume of a checkpoint whose optimizer state is in bitsandbytes' layout
    (what run saved while it built AdamW8bit itself) failed at the first step; the resume converts
    it and, for states bitsandbytes kept in 32 bits (exact), continues bit for bit as the run that
    never stopped, with a note saying so."""
    import io

    from rich.console import Console

    from hydra_train.checkpoint import save_checkpoint
    from hydra_train.run import run_training

    from .conftest import tiny_config
    from .test_trainer import CrashAt, Recorder

    full = Recorder()
    run_training(tiny_config(bin_dataset, tmp_path / "a", max_steps=6, save_every=3), callbacks=[full])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(
            tiny_config(bin_dataset, tmp_path / "b", max_steps=6, save_every=3), callbacks=[CrashAt(5)]
        )
    path = tmp_path / "b" / "hydra_tiny_step3.pt"
    ck = torch.load(path, weights_only=True)
    opt = ck["optimizer"]
    for i, st in opt["state"].items():  # bitsandbytes' 32-bit layout: state1/state2, an int step
        opt["state"][i] = {"step": int(st["step"]), "state1": st["exp_avg"], "state2": st["exp_avg_sq"]}
    for g in opt["param_groups"]:
        g.update(optim_bits=32, min_8bit_size=4096, percentile_clipping=100, block_wise=True)
    save_checkpoint(ck, path)
    out, second = io.StringIO(), Recorder()
    cfg = tiny_config(bin_dataset, tmp_path / "b", max_steps=6, save_every=3, resume=True)
    run_training(cfg, callbacks=[second], console=Console(file=out, width=400))
    assert "bitsandbytes AdamW8bit state (an older --8bit_adam checkpoint) converted" in out.getvalue()
    assert sorted(second.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second.losses[step] == full.losses[step], step
