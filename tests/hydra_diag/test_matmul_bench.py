"""matmul_bench.py on the CPU (the CLI needs CUDA): FLOP, byte and intensity accounting."""

from __future__ import annotations

import pytest

from hydra_diag.matmul_bench import tall_skinny_bench


def test_tall_skinny_accounting():
    out = tall_skinny_bench(rows_m=(64,), inner_k=(32,), outer_n=(1, 16), device="cpu")
    for r in out["rows"]:
        assert r["tflops"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / (r["ms"] * 1e-3) / 1e12)
        assert r["intensity"] == pytest.approx(
            2 * r["m"] * r["n"] * r["k"] / ((64 * 32 + r["n"] * 32 + 64 * r["n"]) * 2)
        )
    assert out["rows"][0]["intensity"] < out["rows"][1]["intensity"]
