"""output.py and render.py: strict JSON out of anything a diagnostic returns; cells and tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from hydra_diag.output import jsonable
from hydra_diag.render import fmt, kv_table, print_findings, rows_table


def test_jsonable_is_strict_json():
    obj = {
        "nan": math.nan,
        "inf": -math.inf,
        "t0": torch.tensor(2.5),
        "t1": torch.tensor([1, 2]),
        "np": np.float32(0.5),
        "arr": np.arange(3),
        "p": Path("/x"),
        "tup": (1, (2, 3)),
        "dtype": torch.bfloat16,
        3: "int key",
    }
    out = jsonable(obj)
    text = json.dumps(out, allow_nan=False)
    back = json.loads(text)
    assert back["nan"] is None and back["inf"] is None and back["t0"] == 2.5 and back["t1"] == [1, 2]
    assert (
        back["arr"] == [0, 1, 2]
        and back["p"] == "/x"
        and back["tup"] == [1, [2, 3]]
        and back["3"] == "int key"
    )
    assert back["dtype"] == "torch.bfloat16"


def test_cells_and_tables():
    assert (
        fmt(None) == "-"
        and fmt(True) == "yes"
        and fmt(0.123456) == "0.1235"
        and fmt([0.5, None]) == "[0.5, -]"
    )
    assert fmt(0.5, ".1%") == "50.0%"
    console = Console(record=True, width=120)
    console.print(rows_table("t", [{"a": 1, "b": "x"}, {"a": 2.5}]))
    console.print(kv_table("kv", {"k": 3}))
    print_findings(console, [], "none here")
    print_findings(console, [{"severity": "error", "kind": "k", "message": "m"}])
    text = console.export_text()
    assert "2.5" in text and "none here: none" in text and "error" in text


def test_brackets_are_text_not_markup():
    console = Console(record=True, width=120)
    console.print(rows_table("sdpa[flash]", [{"impl": "sdpa[cudnn_attention]", "v": ["a[b]", 1.0]}]))
    text = console.export_text()
    assert "sdpa[cudnn_attention]" in text and "[a[b], 1]" in text and "sdpa[flash]" in text
