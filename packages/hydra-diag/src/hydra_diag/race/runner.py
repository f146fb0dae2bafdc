"""The race from start to end: check every configuration, load the data once, race each entrant in
turn (an entrant that fails, e.g. out of memory, is recorded as failed and the others still run;
Ctrl-C stops the race, keeping the entrants that finished), and return the JSON document."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch

from hydra_diag.output import DiagError, DiagUsageError
from hydra_diag.race.configs import RaceConfig, check_buildable
from hydra_diag.race.data import RaceData
from hydra_diag.race.loop import RaceSettings, race_one, release
from hydra_diag.race.progress import RaceProgress
from hydra_diag.race.results import environment, new_document


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise DiagUsageError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DiagError(f"--device {spec}: no CUDA GPU is visible here")
    if dev.type not in ("cpu", "cuda"):
        raise DiagUsageError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N")
    return dev


def run_race(
    cfgs: list[RaceConfig],
    data: RaceData,
    settings: RaceSettings,
    device: torch.device,
    progress: RaceProgress,
    extra_settings: dict[str, Any],
    on_entrant: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The race's document; ``on_entrant(doc)`` after each entrant (the CLI writes the JSON then,
    so a killed process keeps the entrants that finished)."""
    check_buildable(cfgs, settings.model_size, {"vocab_size": data.vocab_size}, usage=False)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # the same TF32 matmuls for every entrant
    doc = new_document(
        {**settings.to_dict(), **extra_settings, "seq_len": data.seq_len, "batch_size": data.batch_size},
        data.summary,
        environment(device),
    )
    for cfg in cfgs:
        progress.start(cfg.name)
        interrupted = False
        try:
            result = race_one(cfg, data, settings, device, progress.say, progress.tick)
        except KeyboardInterrupt:  # Ctrl-C ends the race, but the entrants that finished are kept
            interrupted = True
            result = {**cfg.to_dict(), "status": "interrupted", "error": "interrupted", "evals": []}
        except Exception as exc:  # one entrant failing (OOM, a compile error) must not lose the others
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            result = {**cfg.to_dict(), "status": "failed", "error": last[:500], "evals": []}
            progress.say(f"FAILED: {last[:200]}")
        # outside the except clauses: there the exception's traceback still holds the failed
        # entrant's frame (model, optimizer, activations), which release could not free
        release(device)
        if interrupted:
            progress.warn(f"interrupted during {cfg.name}: the race stops, the finished entrants are kept")
            doc["runs"].append(result)
            break
        progress.done(result)
        if (result.get("epochs") or 0) > 1:
            progress.warn(
                f"{cfg.name} went over the training split {result['epochs']:.2f} times (repeated tokens): "
                "use a larger corpus (--extensions) or a shorter budget"
            )
        doc["runs"].append(result)
        if on_entrant is not None:
            on_entrant(doc)
    return doc
