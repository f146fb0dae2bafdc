"""The metrics database's file format: its name, its tables' columns and the check that a file is
SQLite before anything writes into it. :mod:`hydra_train.metrics_db` reads and writes it.

Tables (primary keys in brackets)::

    models       [model_id] size, params, params_non_embedding, architecture (HydraConfig JSON), created_at
    runs         [run_id] model_id, status (running|finished|stopped|failed|interrupted|killed: a
                 run found dead by the next one), start_step, end_step, best_loss, best_val_loss,
                 final_val_loss, tokens_per_s, resumed_from, device, world_size,
                 config (TrainConfig JSON), started_at, ended_at
    steps        [run_id, step] time, loss, ce_loss, aux_loss, aux (JSON: term -> value), lr, grad_norm,
                 tokens_per_s, tokens_seen, memory_mb, skipped_steps, ema_short, ema_medium, ema_long
    evals        [run_id, step] val_loss, val_ppl
    routing_mod  [run_id, step, layer] selected_frac, capacity, router_prob_mean, compute_savings
    routing_mor  [run_id, step, layer] avg_depth, expected_depth, depth_hist (JSON list)
    routing_moe  [run_id, step, layer] entropy, utilization (JSON list), kl_to_uniform, max_violation
    adaptive_lr  [run_id, step] lr, base_lr, factor, phase (warmup|stable|decay|cosine)
"""

from __future__ import annotations

from pathlib import Path

from hydra_train.errors import HydraDataError

DB_NAME = "training.db"
EXPORT_FORMAT = "hydra-train-diagnostics"

SCHEMA: dict[str, str] = {
    "models": "model_id TEXT PRIMARY KEY, size TEXT, params INTEGER, params_non_embedding INTEGER, "
    "architecture TEXT, created_at TEXT",
    "runs": "run_id TEXT PRIMARY KEY, model_id TEXT, status TEXT, start_step INTEGER, end_step INTEGER, "
    "best_loss REAL, best_val_loss REAL, final_val_loss REAL, tokens_per_s REAL, resumed_from TEXT, "
    "device TEXT, world_size INTEGER, config TEXT, started_at TEXT, ended_at TEXT",
    "steps": "run_id TEXT, step INTEGER, time REAL, loss REAL, ce_loss REAL, aux_loss REAL, aux TEXT, "
    "lr REAL, grad_norm REAL, tokens_per_s REAL, tokens_seen INTEGER, memory_mb REAL, skipped_steps INTEGER, "
    "ema_short REAL, ema_medium REAL, ema_long REAL, PRIMARY KEY (run_id, step)",
    "evals": "run_id TEXT, step INTEGER, val_loss REAL, val_ppl REAL, PRIMARY KEY (run_id, step)",
    "routing_mod": "run_id TEXT, step INTEGER, layer INTEGER, selected_frac REAL, capacity REAL, "
    "router_prob_mean REAL, compute_savings REAL, PRIMARY KEY (run_id, step, layer)",
    "routing_mor": "run_id TEXT, step INTEGER, layer INTEGER, avg_depth REAL, expected_depth REAL, "
    "depth_hist TEXT, PRIMARY KEY (run_id, step, layer)",
    "routing_moe": "run_id TEXT, step INTEGER, layer INTEGER, entropy REAL, utilization TEXT, "
    "kl_to_uniform REAL, max_violation REAL, PRIMARY KEY (run_id, step, layer)",
    "adaptive_lr": "run_id TEXT, step INTEGER, lr REAL, base_lr REAL, factor REAL, phase TEXT, "
    "PRIMARY KEY (run_id, step)",
}


_SQLITE_MAGIC = b"SQLite format 3\x00"


def check_sqlite_file(path: Path, *, allow_empty: bool = True) -> None:
    """Refuse an existing file that is not an SQLite database instead of writing a schema into it:
    it is someone else's file. A 0-byte file is what SQLite itself leaves when a writer dies before
    its first commit: a run may initialise it (``allow_empty``), a read-only command refuses it."""
    if not path.exists():
        return
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise HydraDataError(f"{path}: cannot read the metrics database ({exc.strerror})") from None
    if head != _SQLITE_MAGIC and (head or not allow_empty):
        what = "is empty (0 bytes)" if not head else "is not an SQLite database"
        raise HydraDataError(
            f"{path} {what}; move it away (hydra-train db rebuild recreates it from the "
            "diagnostics_*.json exports)"
        )
