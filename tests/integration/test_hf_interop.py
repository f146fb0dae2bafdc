"""A Llama imported with ``hydra-model import-hf`` is a checkpoint hydra-train accepts.

hydra-train's loader verifies the file (format, checksum, config) and ``hydra-train run --resume``
starts training from its weights at step 0 (a weights-only checkpoint: no optimizer or loop
state). Checked with a tiny random Llama and a run of two steps at a learning rate so small that
the saved weights must still be the imported ones to within that step's size.
"""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

import hydra_kernels
from hydra_model.gpt import GPTModel
from hydra_model.gpt_config import GPTConfig
from hydra_model.hf_import import import_hf
from tests.hydra_model.test_generate_cli import word_tokenizer

VOCAB = 64


@pytest.fixture
def imported(tmp_path):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            initializer_range=0.1,
        )
    )
    llama.save_pretrained(tmp_path / "llama")
    word_tokenizer(tmp_path / "llama" / "tokenizer.json", VOCAB, eos_at=5)
    ckpt_dir = tmp_path / "ckpt"
    result = import_hf(tmp_path / "llama", ckpt_dir / "hydra_gpt-tiny_step0.pt")
    return tmp_path, ckpt_dir, result


def test_hydra_train_loader_verifies_and_accepts_it(imported):
    from hydra_train.checkpoint import check_model_config, find_resume_checkpoint

    _, ckpt_dir, result = imported
    notes: list[str] = []
    point = find_resume_checkpoint(ckpt_dir, log=notes.append)
    assert point is not None and point.step == 0 and not notes  # checksum present and right
    with torch.device("meta"):
        model = GPTModel(GPTConfig.from_dict(result["config"]))
    check_model_config(point.checkpoint, model.config, point.path)  # raises on any difference


def test_hydra_train_resume_starts_from_the_imported_weights(imported):
    from hydra_train.config import TrainConfig
    from hydra_train.run import run_training

    root, ckpt_dir, result = imported
    data = root / "data"
    data.mkdir()
    words = " ".join(f"w{i % 50 + 6}" for i in range(3000))
    (data / "train.txt").write_text(words)
    (data / "tokenizer.json").write_bytes((root / "llama" / "tokenizer.json").read_bytes())
    cfg = result["config"]
    overrides = {k: cfg[k] for k in cfg if k not in ("vocab_size", "use_chunked_ce")}
    lines: list[str] = []
    console = Console(quiet=True)
    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(False)
    try:
        run_cfg = TrainConfig(
            arch="gpt", model_size="tiny", dataset=str(data), seq_len=16, batch_size=2, max_steps=2,
            lr=1e-9, warmup_steps=0, log_every=1, eval_every=2, eval_batches=1, save_every=2,
            checkpoint_dir=str(ckpt_dir), resume=True, device="cpu", cpu_threads=1,
            experimental_prefetch_threads=0, progress=False, model_overrides=overrides,
        )  # fmt: skip
        console.print = lambda *a, **k: lines.append(" ".join(map(str, a)))  # type: ignore[method-assign]
        summary = run_training(run_cfg, console=console)
    finally:
        hydra_kernels.set_use_triton_kernels(was)
    assert summary["steps"] == 2, summary
    assert any("holds weights only" in line for line in lines), lines
    final = torch.load(ckpt_dir / "hydra_gpt-tiny_final.pt", map_location="cpu", weights_only=True)
    start = torch.load(ckpt_dir / "hydra_gpt-tiny_step0.pt", map_location="cpu", weights_only=True)
    for name, tensor in start["model"].items():
        torch.testing.assert_close(final["model"][name], tensor, rtol=0, atol=1e-6)
