"""What inference costs: the FLOPs an evaluation forward executes (counted, not estimated) and
how fast greedy generation runs, for the dense GPT and HYDRA side by side.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one inference-mode
forward of a model built on fake tensors (shapes only: a 100M model at 2048 tokens counts in
seconds on a CPU, and routed shapes are fixed, so the count does not depend on the data). Matrix
products and attention are what it counts; elementwise work is not. torch has no formula for the
CPU attention kernel, so one is added here: QKᵀ and PV, 4·B·Hq·Sq·Sk·d, halved when causal
(every query sees about half the keys), the same rule for every model.

Generation is timed as a person would see it: prompt → ``model.generate(max_new_tokens=N)``,
greedy, after one warm-up generation of the same length; tokens/s counts new tokens only, for a
call that replays the decoder the previous call kept (the default) and for one that builds its
own. Each
``decode`` mode (hydra_model/decode_graphs.py: eager, staged, graphs, or auto, the default) is a
row of its own, with the model's decode report (what ran, routed blocks run and skipped, the
capture time, which is part of every timed generation).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _cpu_attention_flops(
    query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs
) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu`` from its input shapes
    (query [B, Hq, Sq, d], key [B, Hkv, Sk, d]; GQA repeats keys, so Hq counts)."""
    b, hq, sq, d = query
    sk = key[2]
    flops = 4 * b * hq * sq * sk * d
    return flops // 2 if is_causal else flops


def count_eval_flops(arch: str, model_size: str, seq_len: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Inference-mode forward FLOPs per token of ``build_model(arch, model_size, **overrides)``
    at ``seq_len`` (logits included), counted on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    import hydra_kernels
    from hydra_model import build_model

    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(False)  # the references: plain aten ops FlopCounter knows
    try:
        with FakeTensorMode():
            model = build_model(arch, model_size, **overrides).eval()
            tokens = torch.zeros(1, seq_len, dtype=torch.long)
            extra = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}
            with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=extra) as counter:
                model(tokens)
            params = model.num_parameters()
    finally:
        hydra_kernels.set_use_triton_kernels(was)
    total = counter.get_total_flops()
    return {"parameters": params, "seq_len": seq_len, "eval_flops_per_token": total / seq_len}


def time_generation(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    repeats: int = 3,
    decode: str = "auto",
) -> dict[str, Any]:
    """Greedy generation speed of ``model`` from ``prompt`` [B, P] with ``decode``, after one
    warm-up generation: the median of ``repeats`` generations that each build their decoder
    (warm-up step and capture included: a single call's cost) and of ``repeats`` that replay the
    decoder the call before kept (``generate``'s default, what repeated calls cost)."""
    device = prompt.device

    def once(keep: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, decode=decode, keep_decoder=keep)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if out.shape[1] != prompt.shape[1] + new_tokens:
            raise RuntimeError(
                f"generate returned {out.shape[1] - prompt.shape[1]} new tokens, asked {new_tokens}"
            )
        return elapsed

    once(keep=False)  # warm-up: kernels, autotuning, caches
    n = max(1, repeats)
    new = sorted(once(keep=False) for _ in range(n))
    new_report = model.last_decode_report.to_dict()
    once(keep=True)  # builds the decoder the timed calls below replay
    kept = sorted(once(keep=True) for _ in range(n))
    report = model.last_decode_report.to_dict()
    median, median_new = kept[len(kept) // 2], new[len(new) // 2]
    batch = prompt.shape[0]
    return {
        "decode": report["mode"],
        "decode_report": report,
        "decode_report_new_decoder": new_report,
        "batch_size": batch,
        "prompt_tokens": prompt.shape[1],
        "new_tokens": new_tokens,
        "seconds": median,
        "tokens_per_s": batch * new_tokens / median,
        "ms_per_step": 1000.0 * median / new_tokens,
        "seconds_new_decoder": median_new,
        "tokens_per_s_new_decoder": batch * new_tokens / median_new,
    }


def bench_inference(
    model_size: str,
    names: list[str],
    sets: list[str] | None,
    *,
    prompt_len: int,
    new_tokens: int,
    batch_size: int,
    flops_seq_len: int,
    device: str,
    repeats: int,
    decodes: tuple[str, ...] = ("auto",),
    progress=lambda msg: None,
) -> dict[str, Any]:
    """For each race configuration (hydra_diag.race.configs): parameters, counted eval-forward
    FLOPs per token, and greedy generation speed on ``device`` (bf16 weights on CUDA), a row per
    decode mode in ``decodes``."""
    from hydra_diag.race.configs import parse_config_names, parse_sets, resolve_configs
    from hydra_model import build_model

    cfgs = resolve_configs(
        parse_config_names(",".join(names)), parse_sets(sets), lr=1.0, compile_default="none"
    )
    dev = torch.device(device)
    rows = []
    for cfg in cfgs:
        progress(f"{cfg.name}: counting FLOPs")
        base: dict[str, Any] = {"config": cfg.name, "arch": cfg.arch, "overrides": cfg.overrides}
        base.update(count_eval_flops(cfg.arch, model_size, flops_seq_len, cfg.overrides))
        torch.manual_seed(0)
        model = build_model(cfg.arch, model_size, **cfg.overrides).to(dev).eval()
        if dev.type == "cuda":
            model = model.to(torch.bfloat16)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (batch_size, prompt_len), generator=torch.Generator().manual_seed(1))
        outputs = []
        for decode in decodes:
            progress(f"{cfg.name}: generating {new_tokens} tokens × {repeats + 1} (decode {decode})")
            with torch.no_grad():
                row = {**base, **time_generation(model, prompt.to(dev), new_tokens, repeats, decode)}
                outputs.append(model.generate(prompt.to(dev), max_new_tokens=new_tokens, decode=decode))
            row["decode_requested"] = decode
            rows.append(row)
        # every decode mode computes the same steps: greedy tokens must agree (bf16 rounding
        # aside, which can flip a near-tie; the share that agrees is reported, not assumed)
        for row, out in zip(rows[-len(decodes) :], outputs, strict=True):
            row["tokens_agree_with_first_mode"] = float((out == outputs[0]).float().mean())
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    env = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    return {"model_size": model_size, "device": env, "rows": rows}


def render_inference(result: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title=f"inference, {result['model_size']} on {result['device']['device']}")
    for col in ("config", "decode", "params", "GFLOP/tok", "tok/s", "ms/step", "tok/s new"):
        table.add_column(col, justify="left" if col in ("config", "decode") else "right", no_wrap=True)
    for r in result["rows"]:
        table.add_row(
            r["config"],
            r["decode"],
            f"{r['parameters'] / 1e6:.1f}M",
            f"{r['eval_flops_per_token'] / 1e9:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ms_per_step']:.2f}",
            f"{r['tokens_per_s_new_decoder']:,.0f}",
        )
    console.print(
        "tok/s: generate called again, its decoder kept (the default); tok/s new: each call builds "
        "its decoder (warm-up and capture included); GFLOP/tok: eval forward"
    )
    console.print(table)
