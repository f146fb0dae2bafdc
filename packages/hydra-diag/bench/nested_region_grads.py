"""Whether this torch's ``torch.compiler.nested_compile_region`` gives the right gradients under
inductor when one region is called on two modules (their parameters lifted as inputs): the
pattern compiling each HYDRA block once would use. Plain PyTorch on the CPU: two RMSNorm modules
through one region, the gradients of eager, ``aot_eager`` and ``inductor`` compared. On torch
2.13.0+cpu inductor gave the first module's weight a gradient off by 0.32 of its largest entry,
and aot_eager matched exactly (packages/hydra-train/BENCHMARKS.md); run it again before trying
the regions on a newer torch.

    python packages/hydra-diag/bench/nested_region_grads.py
"""

import torch
import torch.nn.functional as F


class Norm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


@torch.compiler.nested_compile_region
def _region(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    return Norm.forward(norm, x)


def main() -> None:
    torch.manual_seed(0)
    embed, first, second = torch.nn.Embedding(10, 16), Norm(16), Norm(16)
    params = {"first.weight": first.weight, "second.weight": second.weight, "embed.weight": embed.weight}
    tokens = torch.randint(0, 10, (2, 8))

    def loss_fn(tok: torch.Tensor) -> torch.Tensor:
        h = embed(tok)
        h = h + 0.5 * _region(first, h)
        return (1.5 * _region(second, h)).pow(2).sum()

    def grads(fn) -> dict[str, torch.Tensor]:
        for p in params.values():
            p.grad = None
        fn(tokens).backward()
        return {name: p.grad.clone() for name, p in params.items()}

    eager = grads(loss_fn)
    print(f"torch {torch.__version__}: gradient error relative to the largest eager entry")
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        got = grads(torch.compile(loss_fn, backend=backend, fullgraph=True))
        errs = {n: float((got[n] - eager[n]).abs().max() / eager[n].abs().max()) for n in params}
        print(f"  {backend:9s} " + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()))


if __name__ == "__main__":
    main()
