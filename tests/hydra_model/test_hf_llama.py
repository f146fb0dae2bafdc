"""The dense GPT out to Hugging Face as a native Llama, and a Llama in as a GPT checkpoint.

Out: ``hydra-model export-hf`` of a GPT gives a folder that transformers loads as
``LlamaForCausalLM`` without remote code, whose logits equal the GPT's (fp32) and whose greedy
generation equals hydra_model's ``generate``; the tokenizer loads with ``AutoTokenizer``. In: a
tiny random ``LlamaForCausalLM`` saved locally becomes a checkpoint that ``load_model`` and
``hydra-model generate`` take, with equal logits; what the GPT cannot compute is refused with a
line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from hydra_model import build_model
from hydra_model.cli import app
from hydra_model.hf_export import ExportError, export_hf
from hydra_model.persistence import load_model

from .conftest import random_tokens
from .test_generate_cli import word_tokenizer

runner = CliRunner()
VOCAB = 97
#: GQA with head_dim · heads ≠ dim, a non-default epsilon and RoPE base: each must be carried over
GPT = dict(
    vocab_size=VOCAB, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    max_seq_len=64, norm_eps=1e-5, rope_base=500.0,
)  # fmt: skip


def random_gpt(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = build_model("gpt", "tiny", **{**GPT, **overrides})
    with torch.no_grad():  # norms away from 1, weights large enough that logits vary
        for p in model.parameters():
            p.add_(0.15 * torch.randn_like(p))
    return model.eval()


def tiny_llama(folder, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    model = LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).eval()
    model.save_pretrained(folder)
    return model


def test_gpt_exports_as_a_native_llama(tmp_path):
    model = random_gpt()
    model.save_pretrained(tmp_path / "gpt")
    word_tokenizer(tmp_path / "gpt" / "tokenizer.json", VOCAB, eos_at=None)
    res = runner.invoke(app, ["export-hf", str(tmp_path / "gpt"), str(tmp_path / "hf"), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["model_type"] == "llama" and report["trust_remote_code"] is False
    assert not list((tmp_path / "hf").glob("*.py"))  # no remote code
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "auto_map" not in cfg and cfg["tie_word_embeddings"] is True

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is LlamaForCausalLM
    hf = loaded.config
    assert (hf.head_dim, hf.num_key_value_heads, hf.rms_norm_eps) == (16, 2, 1e-5)
    assert hf.rope_parameters["rope_theta"] == 500.0
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied
    tokens = random_tokens(3, 40, VOCAB, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=1e-5, atol=2e-5)
    prompt = tokens[:1, :5]
    got = loaded.generate(prompt, max_new_tokens=16, do_sample=False)
    assert got.tolist() == model.generate(prompt, 16).tolist()


def test_the_tokenizer_loads_with_autotokenizer_and_stops_generation(tmp_path):
    model = random_gpt(seed=1)
    model.save_pretrained(tmp_path / "gpt")
    tok = word_tokenizer(tmp_path / "gpt" / "tokenizer.json", VOCAB, eos_at=9)
    result = export_hf(tmp_path / "gpt", tmp_path / "hf", tokenizer=tmp_path / "gpt" / "tokenizer.json")
    assert result.eos_token_id == 9
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("the cat sat")["input_ids"] == tok.encode("the cat sat").ids
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == 9
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 9 and gen["pad_token_id"] == 9


def test_a_ccgqa_gpt_is_refused(tmp_path):
    model = build_model("gpt", "tiny", **{**GPT, "head_dim": 12, "attention": "ccgqa"})
    model.save_pretrained(tmp_path / "gpt")
    with pytest.raises(ExportError, match="ccgqa"):
        export_hf(tmp_path / "gpt", tmp_path / "hf")
    res = runner.invoke(app, ["export-hf", str(tmp_path / "gpt"), str(tmp_path / "hf2"), "--no_tokenizer"])
    assert res.exit_code == 1 and "ccgqa" in res.stderr and not (tmp_path / "hf2").exists()


def test_export_cli_errors(tmp_path):
    model = random_gpt()
    model.save_pretrained(tmp_path / "gpt")
    res = runner.invoke(app, ["export-hf", str(tmp_path / "gpt"), str(tmp_path / "hf")])
    assert res.exit_code == 1 and "no tokenizer" in res.stderr and "--no_tokenizer" in res.stderr
    res = runner.invoke(app, ["export-hf", str(tmp_path / "nothing"), str(tmp_path / "hf")])
    assert res.exit_code == 1 and "does not exist" in res.stderr
    res = runner.invoke(app, ["export-hf", str(tmp_path / "gpt"), str(tmp_path / "hf"), "--dtype", "int8"])
    assert res.exit_code == 2 and "int8" in res.stderr


def test_bfloat16_export_from_a_training_checkpoint_file(tmp_path):
    """A hydra-train checkpoint file (model + config dicts) exports; --dtype bfloat16 halves it."""
    model = random_gpt(seed=2)
    blob = {"model": model.state_dict(), "config": {"model": model.config.to_dict(), "arch": "gpt"}}
    torch.save(blob, tmp_path / "hydra_tiny_final.pt")
    word_tokenizer(tmp_path / "tokenizer.json", VOCAB, eos_at=None)  # where hydra-train keeps it
    args = ["export-hf", str(tmp_path / "hydra_tiny_final.pt"), str(tmp_path / "hf"), "--dtype", "bfloat16"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    tokens = random_tokens(2, 16, VOCAB)
    with torch.no_grad():
        ours, theirs = model(tokens).logits, loaded(tokens).logits.float()
    assert (ours - theirs).abs().max() < 0.05 * ours.abs().max()  # bf16 weights: close, not equal


# --- import ------------------------------------------------------------------------------------


def test_a_llama_imports_as_a_gpt_checkpoint_that_generate_loads(tmp_path):
    llama = tiny_llama(tmp_path / "llama")
    word_tokenizer(tmp_path / "llama" / "tokenizer.json", VOCAB, eos_at=None)
    out = tmp_path / "ckpt" / "llama.pt"
    res = runner.invoke(app, ["import-hf", str(tmp_path / "llama"), str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokenizer"] == str(out.parent / "tokenizer.json")
    gpt = load_model(out).eval()
    assert type(gpt).__name__ == "GPTModel"
    assert (gpt.config.head_dim, gpt.config.n_kv_heads, gpt.config.norm_eps, gpt.config.rope_base) == (
        16, 2, 1e-5, 500.0,
    )  # fmt: skip
    tokens = random_tokens(2, 40, VOCAB, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(gpt(tokens).logits, llama(tokens).logits, rtol=1e-5, atol=2e-5)
    res = runner.invoke(app, ["generate", "--checkpoint", str(out), "--prompt", "the cat sat", "--json"])
    assert res.exit_code == 0, res.output
    ids = json.loads(res.stdout)["generated_ids"]
    expected = llama.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=len(ids), do_sample=False)
    assert ids == expected[0, 3:].tolist()


def test_gpt_to_llama_to_gpt_keeps_every_weight(tmp_path):
    model = random_gpt(seed=4)
    model.save_pretrained(tmp_path / "gpt")
    export_hf(tmp_path / "gpt", tmp_path / "hf")
    res = runner.invoke(app, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "back.pt")])
    assert res.exit_code == 0, res.output
    back = load_model(tmp_path / "back.pt")
    assert back.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_sharded_safetensors_import(tmp_path):
    llama = tiny_llama(tmp_path / "staging")
    llama.save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    res = runner.invoke(app, ["import-hf", str(tmp_path / "llama"), str(tmp_path / "out.pt")])
    assert res.exit_code == 0, res.output
    tokens = random_tokens(1, 12, VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "out.pt")(tokens).logits, llama(tokens).logits)


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("attention_bias", "attention_bias"),
        ("mlp_bias", "mlp_bias"),
        ("not_llama", "model_type 'mistral'"),
        ("untied", "untied LM head"),
        ("scaled_rope", "rope type 'llama3'"),
        ("odd_mlp", "multiple of 64"),
        ("no_safetensors", "no model.safetensors"),
        ("gelu", "hidden_act='gelu'"),
    ],
)
def test_what_the_gpt_cannot_compute_is_refused(tmp_path, case, message):
    folder = tmp_path / "llama"
    if case in ("attention_bias", "mlp_bias"):
        tiny_llama(folder, **{case: True})
    elif case == "untied":
        tiny_llama(folder, tie_word_embeddings=False)
    elif case == "odd_mlp":
        tiny_llama(folder, intermediate_size=100)
    else:
        tiny_llama(folder)
    if case == "not_llama":
        _edit_config(folder, model_type="mistral")
    elif case == "scaled_rope":
        scaling = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}
        _edit_config(folder, rope_parameters=scaling)
    elif case == "gelu":
        _edit_config(folder, hidden_act="gelu")
    elif case == "no_safetensors":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    res = runner.invoke(app, ["import-hf", str(folder), str(tmp_path / "out.pt")])
    assert res.exit_code == 1, res.output
    assert message in res.stderr and "\n" not in res.stderr.strip()
    assert not (tmp_path / "out.pt").exists()


def test_an_export_replaces_an_earlier_one_in_the_same_folder(tmp_path):
    from .conftest import small_model

    small_model().save_pretrained(tmp_path / "hydra")
    word_tokenizer(tmp_path / "hydra" / "tokenizer.json", VOCAB, eos_at=None)
    export_hf(tmp_path / "hydra", tmp_path / "hf", tokenizer=tmp_path / "hydra" / "tokenizer.json")
    (tmp_path / "hf" / "README.md").write_text("mine")
    random_gpt().save_pretrained(tmp_path / "gpt")
    export_hf(tmp_path / "gpt", tmp_path / "hf")  # no tokenizer this time
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")) is LlamaForCausalLM
