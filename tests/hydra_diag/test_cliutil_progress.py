"""hydra-diag's progress lines off a terminal: elapsed time first, the message verbatim."""

from __future__ import annotations

import re

from hydra_diag.cliutil import progress


def test_plain_progress_line_keeps_brackets(capsys):
    with progress("health model") as say:
        say("pip install 'hydra-train[tensorboard]' for data[1]/x.bin")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert re.fullmatch(
        r"\[\s*\d+\.\ds\] health model: pip install 'hydra-train\[tensorboard\]' for data\[1\]/x\.bin", err[0]
    ), err[0]
