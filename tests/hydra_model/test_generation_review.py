"""generate and ``hydra-model generate`` from a review: per-sequence end-of-text in a batch against
the full forward for both architectures; arguments a generation cannot use named before anything
runs; the CLI's device, temperature and tokenizer errors; its printed text exactly the decoded
tokens in a pipe; tokens the tokenizer cannot decode, an end-of-text the model cannot produce and
--top-k/--top-p ignored by greedy decoding reported, not silently lost."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hydra_model import build_model
from hydra_model.cli import app

from .conftest import random_tokens
from .test_generate_cli import word_tokenizer

runner = CliRunner()
VOCAB = 97


def fresh_model(arch: str, seed: int) -> torch.nn.Module:
    """A random tiny model of ``arch`` whose greedy continuations vary (the input embedding
    scaled down so that the blocks, not the tied head's echo of the last token, decide)."""
    torch.manual_seed(seed)
    model = build_model(arch, "tiny", vocab_size=VOCAB, max_seq_len=64, init_std=0.2)
    with torch.no_grad():
        model.embed.weight.mul_(0.1)
    return model.eval()


def reference(model, prompt: torch.Tensor, steps: int, eos: int | None) -> torch.Tensor:
    """Greedy decoding by full forwards on the growing sequence (fp64), each sequence on its own:
    its tokens up to and including its first ``eos``, then ``eos`` to the batch's longest."""
    rows = []
    model64 = model.double()
    try:
        with torch.no_grad():
            for row in prompt:
                seq = row[None]
                for _ in range(steps):
                    nxt = model64(seq).logits[:, -1].argmax(-1, keepdim=True)
                    seq = torch.cat([seq, nxt], dim=1)
                    if eos is not None and int(nxt) == eos:
                        break
                rows.append(seq[0])
    finally:
        model.float()
    width = max(len(r) for r in rows)
    fill = -1 if eos is None else eos
    return torch.stack([torch.cat([r, r.new_full((width - len(r),), fill)]) for r in rows])


@pytest.mark.parametrize("decode", ["eager", "staged"])
@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_each_sequence_stops_at_its_own_end_of_text(arch, decode):
    model = fresh_model(arch, seed=4)
    prompt = random_tokens(3, 6, seed=5)
    free = reference(model, prompt, 10, eos=None)
    eos = int(free[1, 6 + 2])  # the third token of the middle row; the others may differ
    got = model.generate(prompt, 10, eos_token_id=eos, decode=decode)
    want = reference(model, prompt, 10, eos=eos)
    assert torch.equal(got, want)
    assert (got[1, 6:] == eos).sum() >= 1 and got.shape[1] <= 16


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_an_end_of_text_outside_the_vocabulary_is_named(arch, monkeypatch):
    """An id the model can never produce would never stop the generation: refused before the
    prefill, like a prompt's ids."""
    model = fresh_model(arch, seed=0)
    ran = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: ran.append(1))
    for eos in (VOCAB, VOCAB + 50, -1):
        with pytest.raises(ValueError, match=rf"eos_token_id={eos}.*0\.\.{VOCAB - 1}"):
            model.generate(random_tokens(1, 4), 3, eos_token_id=eos)
    assert not ran


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_new_tokens": 4.0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": 1.0, "top_k": 2.5}, "top_k"),
        ({"max_new_tokens": 4, "eos_token_id": 3.0}, "eos_token_id"),
    ],
)
def test_a_non_integer_count_is_a_type_error_naming_it(kwargs, name, monkeypatch):
    model = fresh_model("gpt", seed=0)
    ran = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: ran.append(1))
    with pytest.raises(TypeError, match=name):
        model.generate(random_tokens(1, 4), **kwargs)
    assert not ran


def test_integer_like_counts_are_taken():
    """numpy and 0-d tensor integers are ints to Python's index protocol: they still work."""
    np = pytest.importorskip("numpy")
    model = fresh_model("gpt", seed=1)
    prompt = random_tokens(2, 4)
    want = model.generate(prompt, 5)
    assert torch.equal(model.generate(prompt, np.int64(5)), want)
    assert torch.equal(model.generate(prompt, torch.tensor(5)), want)


# ----------------------------------------------------------------------------- the CLI


def saved(tmp_path, arch: str = "gpt", seed: int = 0):
    model = fresh_model(arch, seed)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    return model, folder


def invoke(folder, *extra):
    args = ["generate", "--checkpoint", str(folder), "--prompt", "the cat sat"]
    return runner.invoke(app, [*args, *extra])


def tab_tokenizer(path, size: int):
    """A word-level tokenizer whose made-up words hold a tab ("the cat sat" is ids 1, 2, 3)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = ["[UNK]", "the", "cat", "sat", *(f"w{i}\tx" for i in range(4, size))]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_the_printed_text_is_the_decoded_tokens_in_a_pipe(tmp_path, arch):
    """Piped (not a terminal), stdout is the prompt and the decoded text as they are: rich wrapped
    it at 80 columns and expanded its tabs."""
    model, folder = saved(tmp_path, arch)
    tok = tab_tokenizer(folder / "tokenizer.json", VOCAB)
    new = model.generate(torch.tensor([[1, 2, 3]]), 40)[0, 3:].tolist()
    want = "the cat sat" + tok.decode(new)
    assert "\t" in want and len(want) > 120  # what the test is about
    res = invoke(folder, "--device", "cpu", "--max_new_tokens", "40")
    assert res.exit_code == 0, res.output
    assert res.stdout == want + "\n"


@pytest.mark.parametrize("value", ["inf", "-inf"])
def test_an_infinite_temperature_is_a_usage_error(tmp_path, value):
    _, folder = saved(tmp_path)
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    res = invoke(folder, "--device", "cpu", "--temperature", value)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "--temperature" in res.stderr


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:x"])
def test_a_device_that_is_no_device_is_a_usage_error_naming_it(tmp_path, device):
    """It said the checkpoint was "unreadable, probably truncated or corrupt"."""
    _, folder = saved(tmp_path)
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    res = invoke(folder, "--device", device)
    assert res.exit_code == 2, res.output
    assert f"--device {device!r}" in res.stderr and "corrupt" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_where_there_is_none_says_so(tmp_path):
    """It said "could not load ...: pin_memory=True requires a CUDA or other accelerator"."""
    _, folder = saved(tmp_path)
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    for device in ("cuda", "cuda:0"):
        res = invoke(folder, "--device", device)
        assert res.exit_code == 1, res.output
        assert "no CUDA GPU" in res.stderr and "--device cpu" in res.stderr
    res = invoke(folder, "--device", "auto", "--max_new_tokens", "2", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["threads"] is not None  # auto: the CPU


def test_a_tokenizer_folder_is_named_as_a_folder(tmp_path):
    _, folder = saved(tmp_path)
    res = invoke(folder, "--device", "cpu", "--tokenizer", str(tmp_path))
    assert res.exit_code == 1, res.output
    assert "is a folder" in res.stderr and "does not exist" not in res.stderr


def test_an_end_of_text_the_model_cannot_produce_is_reported(tmp_path):
    """A tokenizer larger than the model's vocabulary, its end-of-text past it: a warning, and the
    generation runs to --max_new_tokens (it stopped nowhere, silently)."""
    model, folder = saved(tmp_path)
    word_tokenizer(folder / "tokenizer.json", VOCAB + 10, eos_at=VOCAB + 3)
    res = invoke(folder, "--device", "cpu", "--max_new_tokens", "5", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["generated_ids"] == model.generate(torch.tensor([[1, 2, 3]]), 5)[0, 3:].tolist()
    assert data["eos_token_id"] is None and data["stopped_at_eos"] is False
    assert f"end-of-text id {VOCAB + 3}" in res.stderr and f"0..{VOCAB - 1}" in res.stderr


def test_tokens_the_tokenizer_cannot_decode_are_reported(tmp_path):
    """A model vocabulary larger than the tokenizer's (hydra-train's --vocab_size may pad it):
    ids past the tokenizer have no text and vanished from it silently."""
    model, folder = saved(tmp_path)
    tok = word_tokenizer(folder / "tokenizer.json", 30, eos_at=None)
    res = invoke(folder, "--device", "cpu", "--max_new_tokens", "12", "--json")
    assert res.exit_code == 0, res.output
    ids = json.loads(res.stdout)["generated_ids"]
    assert ids == model.generate(torch.tensor([[1, 2, 3]]), 12)[0, 3:].tolist()
    lost = [i for i in ids if tok.id_to_token(i) is None]
    assert lost  # the fixed seed's continuation has some: what the test is about
    assert f"{len(lost)} of the 12 generated tokens" in res.stderr
    assert str(sorted(set(lost))[0]) in res.stderr
    # all decodable: no note
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    res = invoke(folder, "--device", "cpu", "--max_new_tokens", "12")
    assert res.exit_code == 0 and "generated tokens" not in res.stderr


def test_cpu_with_an_index_is_the_cpu(tmp_path):
    """--device cpu:0 ran on the CPU but the JSON's threads said null (it compared with "cpu")."""
    _, folder = saved(tmp_path)
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    res = invoke(folder, "--device", "cpu:0", "--max_new_tokens", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["threads"] == torch.get_num_threads()


def test_top_k_or_top_p_without_a_temperature_says_it_is_greedy(tmp_path):
    """--top-k/--top-p with the default --temperature 0 decode greedily: said on stderr (a user
    asking for nucleus sampling got the same text for every --seed without a word)."""
    model, folder = saved(tmp_path)
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    greedy = model.generate(torch.tensor([[1, 2, 3]]), 6)[0, 3:].tolist()
    for extra in (["--top-k", "5"], ["--top-p", "0.9"], ["--top-k", "5", "--top-p", "0.9"]):
        res = invoke(folder, "--device", "cpu", "--max_new_tokens", "6", "--json", *extra)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["generated_ids"] == greedy
        assert "greedy" in res.stderr and all(opt in res.stderr for opt in extra[::2])
    res = invoke(folder, "--device", "cpu", "--max_new_tokens", "6", "--temperature", "1", "--top-k", "5")
    assert res.exit_code == 0 and "greedy" not in res.stderr
