"""A checkpoint written by a real hydra-train run loads in hydra-model and generates text.

The two packages meet only through the checkpoint file's layout, so this is checked end to end:
train a few steps on a small text dataset with its own tokenizer, then load the final checkpoint
with ``hydra_model``'s loader and run ``hydra-model generate`` on it (tokenizer found beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from rich.console import Console

import hydra_kernels

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hydra_train.config import TrainConfig
    from hydra_train.run import run_training

    root = tmp_path_factory.mktemp("interop")
    data = root / "data"
    data.mkdir()
    corpus = [TEXT[i % len(TEXT)] + f"# note {i}\n" for i in range(400)]
    (data / "train.txt").write_text("".join(corpus))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        show_progress=False,
        special_tokens=["<|endoftext|>"],  # hydra-train appends it after each document
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(data / "tokenizer.json"))

    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(False)  # the references: the interpreter is slow
    try:
        cfg = TrainConfig(
            model_size="tiny", dataset=str(data), seq_len=32, batch_size=4, max_steps=6,
            log_every=3, eval_every=6, eval_batches=1, save_every=6, checkpoint_dir=str(root / "ckpt"),
            device="cpu", cpu_threads=1, experimental_prefetch_threads=0, progress=False,
            model_overrides={"dim": 64},
        )  # fmt: skip
        summary = run_training(cfg, console=Console(quiet=True))
    finally:
        hydra_kernels.set_use_triton_kernels(was)
    return root / "ckpt", summary


def test_trained_checkpoint_loads_in_hydra_model(trained) -> None:
    from hydra_model import CCGQAMoDMoRModel
    from hydra_model.persistence import load_checkpoint_file

    ckpt_dir, summary = trained
    final = ckpt_dir / "hydra_tiny_final.pt"
    assert final.is_file() and (ckpt_dir / "tokenizer.json").is_file()
    model = load_checkpoint_file(CCGQAMoDMoRModel, final)
    blob = torch.load(final, map_location="cpu", weights_only=True)
    for name, tensor in model.state_dict().items():  # every weight is the trained one
        saved = blob["model"].get(name, blob["model"].get(f"_orig_mod.{name}"))
        if saved is not None:
            assert torch.equal(tensor, saved), name
    assert model.config.dim == 64 and model.config.vocab_size == summary.get("vocab_size", 300)


def test_hydra_model_generate_cli_on_a_training_checkpoint(trained) -> None:
    ckpt_dir, _ = trained
    final = str(ckpt_dir / "hydra_tiny_final.pt")
    proc = subprocess.run(
        [sys.executable, "-m", "hydra_model", "generate", "--checkpoint", final,
         "--prompt", "def add(", "--max-new-tokens", "5", "--device", "cpu", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["generated_ids"]) == 5
    # the CLI's greedy continuation is the loaded model's own greedy continuation
    from tokenizers import Tokenizer

    from hydra_model import CCGQAMoDMoRModel
    from hydra_model.persistence import load_checkpoint_file

    tok = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
    assert out["prompt_ids"] == tok.encode("def add(").ids
    model = load_checkpoint_file(CCGQAMoDMoRModel, ckpt_dir / "hydra_tiny_final.pt").eval()
    prompt = torch.tensor([out["prompt_ids"]])
    expected = model.generate(prompt, max_new_tokens=5)[0, prompt.shape[1] :].tolist()
    assert out["generated_ids"] == expected
    assert out["text"] == tok.decode(expected)


def test_export_hf_ships_the_runs_tokenizer_and_loads_in_transformers(trained, tmp_path) -> None:
    """`hydra-model export-hf` on the final checkpoint (the README's follow-up): the tokenizer the
    run copied beside it goes into the folder, and transformers loads model and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hydra_model import CCGQAMoDMoRModel
    from hydra_model.persistence import load_checkpoint_file

    ckpt_dir, _ = trained
    final = ckpt_dir / "hydra_tiny_final.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "hydra_model", "export-hf", str(final), str(tmp_path / "hf"), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (ckpt_dir / "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("def add(a, b):", return_tensors="pt")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    model = load_checkpoint_file(CCGQAMoDMoRModel, final).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=2e-5)
    assert hf.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
