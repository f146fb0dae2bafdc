"""A run's model config of its own architecture (the train config's ``arch``): a dense-GPT run's
database gives its GPTConfig, ``RunData.model_config()`` stays the HYDRA-only accessor (None for
GPT) that watchdog.py and loss_components.py rely on."""

from __future__ import annotations

import pytest

from hydra_diag.output import DiagError
from hydra_diag.run_db import load_run
from hydra_diag.short_runs import run_model_config

from .conftest import synthetic_db

ROWS = [{"step": s, "loss": 4.0, "ce_loss": 4.0, "aux": {}, "lr": 1e-3} for s in (1, 2)]


def _gpt_db(tmp_path):
    from hydra_model import gpt_config

    written = gpt_config("tiny", vocab_size=321)
    folder = synthetic_db(tmp_path, ROWS, model_config=written.to_dict(), train_config={"arch": "gpt"})
    return folder, written


def test_a_gpt_runs_config_is_its_gpt_config(tmp_path):
    from hydra_model import GPTConfig

    folder, written = _gpt_db(tmp_path)
    data = load_run(folder)
    assert data.arch == "gpt"
    cfg = data.architecture_config()
    assert isinstance(cfg, GPTConfig) and cfg.to_dict() == written.to_dict()
    assert data.model_config() is None  # the HYDRA config its callers ask for: it has none


def test_short_runs_model_config_of_a_gpt_run(tmp_path):
    from hydra_model import GPTConfig, flops_per_token

    folder, written = _gpt_db(tmp_path)
    summary = {"database": str(folder / "training.db"), "model_id": "tiny", "run_id": "run1"}
    cfg = run_model_config(summary)  # a ValueError traceback (HydraConfig.from_dict) before
    assert isinstance(cfg, GPTConfig) and cfg.to_dict() == written.to_dict()
    assert flops_per_token(cfg, 64) == flops_per_token(written, 64)


def test_a_hydra_run_and_one_recorded_before_arch(tmp_path):
    from hydra_model import HydraConfig

    for i, train_config in enumerate(({"arch": "hydra"}, {"max_steps": 2})):  # no arch: HYDRA
        data = load_run(synthetic_db(tmp_path / str(i), ROWS, train_config=train_config))
        assert data.arch == "hydra" and isinstance(data.architecture_config(), HydraConfig)
        assert data.model_config().to_dict() == data.architecture_config().to_dict()


def test_a_config_that_is_not_of_the_recorded_arch_is_a_diag_error(tmp_path):
    from hydra_model import gpt_config

    folder = synthetic_db(tmp_path, ROWS, model_config=gpt_config("tiny").to_dict(), train_config={})
    with pytest.raises(DiagError, match="hydra"):
        load_run(folder).architecture_config()
    # the lenient accessor its callers use (watchdog, loss components) goes on without it
    assert load_run(folder).model_config() is None
