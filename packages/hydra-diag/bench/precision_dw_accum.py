"""How precisely must linear+CE accumulate dW over token chunks? An fp64 emulation (CPU).

    python packages/hydra-diag/bench/precision_dw_accum.py --n 16384 --d 64 --v 4096 \
        --chunk 1024 --chunk 256

dW = Σ_chunks G_cᵀ h_c. torch computes G from bf16 logits in fp32, rounds it to bf16 and forms
dW in one GEMM, rounded once. The emulation gives every scheme torch's G (the op's row kernel
matches it but for rare midpoint flips, which ``grad_rounding_atol`` allows for), forms each
chunk's product exactly and rounds it to fp32 (a GEMM with an fp32 output), and accumulates:

- ``fp32``: an fp32 running sum, rounded to bf16 at the end (the ``fp32`` scheme);
- ``bf16``: the running sum rounded to bf16 after every chunk (``input``, Liger's);
- ``loB``: bf16 plus a B-bit residual in units of ulp/2^B (``compensated`` is B = 4).

Each result is judged by the project criterion against the fp64 gradient,
``|got − ref64| ≤ 2·|torch − ref64| + atol`` with the tests' atol (16 fp32 ulps of the largest
value plus ``grad_rounding_atol``'s eps·(max_n |G·h| + |ref|)): the table shows the worst ratio
(≤ 1 passes) and the share of elements over 1. Prints one line per chunk size; JSON with --json.
"""

import json
import math
from typing import Annotated

import torch
import typer


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float().double()


def _grad(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(x, 1)
    p[valid, y[valid]] -= 1
    return p * valid[:, None] / valid.sum()


def _ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    return 2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(1e-38))) - 7)


def _accumulate(gt: torch.Tensor, h: torch.Tensor, rows: int, mode: str, bits: int) -> torch.Tensor:
    v, d = gt.shape[1], h.shape[1]
    hi = torch.zeros(v, d, dtype=torch.float64)
    lo = torch.zeros_like(hi)
    for s in range(0, h.shape[0], rows):
        part = _fp32(gt[s : s + rows].t() @ h[s : s + rows])
        if mode == "fp32":
            hi = _fp32(hi + part)
        elif mode == "bf16":
            hi = _bf16(hi + part)
        else:
            total = _fp32(hi + lo + part)
            hi = _bf16(total)
            q = _ulp_bf16(hi) * 2.0**-bits
            code = torch.round((total - hi) / q).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            lo = torch.where(hi == 0, 0.0, code * q)
    return _bf16(hi) if mode == "fp32" else hi


def main(
    n: Annotated[int, typer.Option(help="Tokens.")] = 4096,
    d: Annotated[int, typer.Option(help="Hidden width.")] = 64,
    v: Annotated[int, typer.Option(help="Vocabulary.")] = 1024,
    wscale: Annotated[float, typer.Option(help="Std of W (logit std ≈ wscale·√D).")] = 0.07,
    chunk: Annotated[list[int] | None, typer.Option(help="Chunk rows (repeatable).")] = None,
    bits: Annotated[list[int] | None, typer.Option(help="Residual bits to try (repeatable).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Worst criterion ratio of dW accumulated over chunks in fp32, bf16 and bf16 + B bits."""
    gen = torch.Generator().manual_seed(seed)
    h = _bf16(torch.randn(n, d, generator=gen, dtype=torch.float64))
    w = _bf16(wscale * torch.randn(v, d, generator=gen, dtype=torch.float64))
    y = torch.randint(0, v, (n,), generator=gen)
    y[torch.rand(n, generator=gen) < 0.2] = -100
    valid = y != -100
    x64 = h @ w.t()
    g64 = _grad(x64, y, valid)
    ref = g64.t() @ h
    gt = _bf16(_fp32(_grad(_bf16(x64), y, valid)))  # torch's G: bf16 logits, fp32 softmax, bf16
    t_err = (_bf16(gt.t() @ h) - ref).abs()
    biggest = torch.zeros(v, d, dtype=torch.float64)
    for s in range(0, n, 32):  # max_n |G·h| without an [N, V, D] temporary
        torch.maximum(
            biggest, (g64[s : s + 32, :, None].abs() * h[s : s + 32, None, :].abs()).amax(0), out=biggest
        )
    atol = 16 * 2.0**-23 * float(ref.abs().max()) + 2.0**-7 * (biggest + ref.abs())
    out = {"n": n, "d": d, "v": v, "logit_std": float(x64.std()), "seed": seed, "rows": []}
    for rows in chunk or [1024, 256]:
        line = {"chunk": rows, "chunks": math.ceil(n / rows)}
        for mode, b in [("fp32", 0), ("bf16", 0), *[("lo", b) for b in bits or [3, 4]]]:
            ratio = (_accumulate(gt, h, rows, mode, b) - ref).abs() / (2 * t_err + atol)
            line[f"lo{b}" if mode == "lo" else mode] = (
                float(ratio.max()),
                float((ratio > 1).double().mean()),
            )
        out["rows"].append(line)
        if not as_json:
            cells = ", ".join(f"{k} {r:.2f} ({f * 100:.3f}% over)" for k, (r, f) in list(line.items())[2:])
            print(f"N={n} D={d} V={v} chunk={rows} ({line['chunks']} chunks): {cells}", flush=True)
    if as_json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    typer.run(main)
