"""A training step of stock transformers models: stock vs ``hydra_kernels.patch`` vs Liger.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/bench_patch.py --out bench/results/bench_patch.json

Models (random weights, bf16, SDPA attention): a small Llama (12 × 768, GQA 12/4, SwiGLU 2048,
vocab 32000, untied head) and Qwen2-0.5B's shape (24 × 896, GQA 14/2, SwiGLU 4864, q/k/v biases,
vocab 151936, tied head). One step is ``model(input_ids, labels).loss.backward()`` (forward and
backward, no optimizer: the same for every variant).

Variants: ``stock``; ``hydra`` (``hydra_kernels.patch(model)``: RMSNorm, SwiGLU MLP, RoPE and the
fused linear cross-entropy in the loss); ``liger`` (``apply_liger_kernel_to_llama`` /
``apply_liger_kernel_to_qwen2`` with the model, its defaults: the same four), skipped with a note
when liger_kernel is not importable. Each (model, variant) runs in its own process, because both
patches change transformers' modeling modules for the whole process.

Correctness first, in each process: the fp32 model's loss and gradients on a check batch are the
reference; the bf16 model under the variant is compared with them (relative error of the loss
and of all gradients together). A variant passes when its errors are at most twice the stock
bf16 model's own plus 1e-3. Then the step is timed (CUDA events, median of --steps after
--warmup) with the peak memory. A table goes to stdout, everything to --out as JSON ($OUT/
bench_patch.json by default when $OUT is set). Exit 1 when a variant fails its check.
``--smoke`` runs tiny models on the CPU (Triton interpreted) to try the script itself (Liger's
kernels do not run in Triton's interpreter: its rows then report the error).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

if "--smoke" in sys.argv:  # before torch and triton are imported: interpret the kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import typer

SRC = Path(__file__).resolve().parents[2] / "hydra-kernels" / "src"
if importlib.util.find_spec("hydra_kernels") is None:  # a checkout without the package installed
    sys.path.insert(0, str(SRC))

MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(
        family="llama",
        config=dict(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
        ),
        batch=8, seq=2048, check_batch=2, check_seq=512,
    ),
    "qwen2": dict(
        family="qwen2",
        config=dict(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
        ),
        batch=4, seq=2048, check_batch=1, check_seq=512,
    ),
}  # fmt: skip
SMOKE = dict(
    config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    batch=2, seq=32, check_batch=1, check_seq=16,
)  # fmt: skip
VARIANTS = ("stock", "hydra", "liger")


def _classes(family: str):
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    cfg, model = names[family]
    return getattr(transformers, cfg), getattr(transformers, model)


def _batch(vocab: int, b: int, s: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[:, : s // 8] = -100  # a prompt part that is not trained on
    return ids.to(device), labels.to(device)


def _loss_and_grads(model, ids, labels) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def _apply(variant: str, family: str, model) -> dict[str, Any]:
    if variant == "hydra":
        import hydra_kernels

        record = hydra_kernels.patch(model)
        return {"replaced": record.counts(), "skipped": record.skipped}
    if variant == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{family}")(model=model)
        return {"liger_kernel": importlib.metadata.version("liger-kernel")}
    return {}


def run_worker(name: str, variant: str, smoke: bool, steps: int, warmup: int) -> dict[str, Any]:
    spec = {**MODELS[name], **(SMOKE if smoke else {})}
    device = torch.device("cpu" if smoke else "cuda")
    config_cls, model_cls = _classes(MODELS[name]["family"])
    torch.manual_seed(0)
    config = config_cls(**spec["config"], attn_implementation="sdpa")
    model = model_cls(config).to(device).train()
    vocab = spec["config"]["vocab_size"]
    ids, labels = _batch(vocab, spec["check_batch"], spec["check_seq"], 1, device)
    ref_loss, ref_grads = _loss_and_grads(model, ids, labels)  # fp32, stock: the reference
    model.to(torch.bfloat16)
    info = _apply(variant, MODELS[name]["family"], model)
    loss, grads = _loss_and_grads(model, ids, labels)
    diff = sum(float((grads[n] - g).square().sum()) for n, g in ref_grads.items() if n in grads)
    norm = sum(float(g.square().sum()) for g in ref_grads.values())
    check = {
        "loss": loss,
        "ref_loss": ref_loss,
        "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_err": (diff / norm) ** 0.5,
        "missing_grads": sorted(set(ref_grads) - set(grads)),
    }
    del ref_grads, grads
    ids, labels = _batch(vocab, spec["batch"], spec["seq"], 2, device)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed = begin.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - start) * 1e3
        if i >= warmup:
            times.append(elapsed)
    ms = statistics.median(times)
    tokens = spec["batch"] * spec["seq"]
    return {
        "model": name,
        "variant": variant,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": spec["batch"],
        "seq": spec["seq"],
        "ms_per_step": ms,
        "ms_all": times,
        "tokens_per_s": tokens / ms * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "check": check,
        **info,
    }


def _environment() -> dict[str, Any]:
    import transformers
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if importlib.util.find_spec("liger_kernel") is not None:
        env["liger_kernel"] = importlib.metadata.version("liger-kernel")
    return env


def _judge(rows: list[dict[str, Any]]) -> None:
    """Each variant's errors against the stock bf16 model's own (2× plus 1e-3)."""
    stock = {r["model"]: r["check"] for r in rows if r["variant"] == "stock" and "check" in r}
    for r in rows:
        base = stock.get(r["model"])
        if "check" not in r or base is None:
            continue
        c = r["check"]
        c["passed"] = (
            not c["missing_grads"]
            and c["loss_rel_err"] <= 2 * base["loss_rel_err"] + 1e-3
            and c["grad_rel_err"] <= 2 * base["grad_rel_err"] + 1e-3
        )


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<7} {'variant':<7} {'ms/step':>9} {'tok/s':>10} {'vs stock':>8} {'GiB':>6} "
          f"{'loss err':>9} {'grad err':>9} check")  # fmt: skip
    stock = {r["model"]: r for r in rows if r["variant"] == "stock" and "ms_per_step" in r}
    for r in rows:
        if "ms_per_step" not in r:
            print(f"{r['model']:<7} {r['variant']:<7} skipped: {r.get('skipped_reason', r.get('error'))}")
            continue
        c, base = r["check"], stock.get(r["model"])
        speed = f"{base['ms_per_step'] / r['ms_per_step']:.2f}x" if base else "-"
        gib = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"{r['model']:<7} {r['variant']:<7} {r['ms_per_step']:>9.2f} {r['tokens_per_s']:>10.0f} "
              f"{speed:>8} {gib:>6} {c['loss_rel_err']:>9.1e} {c['grad_rel_err']:>9.1e} "
              f"{'ok' if c.get('passed') else 'FAIL'}")  # fmt: skip


def main(
    models: Annotated[str, typer.Option(help="Comma-separated: llama, qwen2.")] = "llama,qwen2",
    variants: Annotated[str, typer.Option(help="Comma-separated: stock, hydra, liger.")] = ",".join(VARIANTS),
    steps: Annotated[int, typer.Option(help="Timed steps per variant.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed steps first (Triton compiles).")] = 3,
    out: Annotated[Path | None, typer.Option(help="JSON file (default: $OUT/bench_patch.json).")] = None,
    smoke: Annotated[bool, typer.Option(help="Tiny models on the CPU, to try the script.")] = False,
    worker: Annotated[str | None, typer.Option(hidden=True)] = None,
) -> None:
    """Time a bf16 training step of small Llama / Qwen2 models: stock, hydra patch(), Liger."""
    if worker is not None:  # one (model, variant) in this process; the result as JSON on stdout
        name, variant = worker.split(":")
        print("RESULT " + json.dumps(run_worker(name, variant, smoke, steps, warmup)))
        return
    if not smoke and not torch.cuda.is_available():
        print("bench_patch: needs a CUDA GPU (or --smoke to try the script on the CPU)", file=sys.stderr)
        raise typer.Exit(1)
    have_liger = importlib.util.find_spec("liger_kernel") is not None
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_patch.json"
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if out is not None:
            _judge(rows)
            result = {"environment": _environment(), "smoke": smoke, "steps": steps, "warmup": warmup}
            result["rows"] = rows
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")

    for name in models.split(","):
        for variant in variants.split(","):
            if variant == "liger" and not have_liger:
                why = "liger_kernel not importable"
                print(f"note: {why}: {name}/liger skipped (carry its wheel in .whl/)")
                rows.append({"model": name, "variant": variant, "skipped_reason": why})
                continue
            args = [sys.executable, __file__, "--worker", f"{name}:{variant}", "--steps", str(steps)]
            args += ["--warmup", str(warmup)] + (["--smoke"] if smoke else [])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
            proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not found:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                tail = [ln for ln in lines if not any(c in ln for c in "│╭╰")][-2:]  # no traceback boxes
                rows.append({"model": name, "variant": variant, "error": " | ".join(tail)})
            else:
                rows.append(json.loads(found[-1][len("RESULT ") :]))
            save()
            print(f"{name}/{variant}: done", file=sys.stderr)
    _judge(rows)
    _print_table(rows)
    if out is not None:
        print(f"wrote {out}")
    failed = [r for r in rows if "error" in r or ("check" in r and not r["check"].get("passed"))]
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
