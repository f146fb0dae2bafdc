"""HYDRA exported for Hugging Face: the shipped remote code computes what hydra_model computes.

The shipped modeling code (hydra_model/hf_remote/) is an independent implementation of HYDRA's
inference forward, so these tests are what keeps it true to hydra_model: on configurations that
cover every routing mode an exported model can hold (causal and expert-choice routing, MoD on
and off, one and several recursions, static, token choice, routing off, MoE with both
balancings, a size preset), the model that ``AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`` loads gives hydra_model's logits in fp32 and the same greedy tokens
as hydra_model's own ``generate`` (the path of ``hydra-model generate``). Routing thresholds and
balance biases are set to random values first, so that routing points really take some tokens
and leave others (checked), and a changed threshold is shown to change the logits.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hydra_model import create_ccgqa_mod_mor_model
from hydra_model.hf_export import export_hf
from hydra_model.hf_hydra import REMOTE_CODE_DIR, REMOTE_CODE_FILES, UnsupportedModelError, hydra_layout

from .conftest import MODES, random_tokens, small_model

#: name → HydraConfig overrides of the SMALL config: every routing mode the other model tests
#: cover (conftest.MODES), and what only an export has to get right besides
CONFIGS = {
    **MODES,
    "mod_off_one_recursion": {"mod_enabled": False, "recursions_per_block": 1},
    "one_recursion": {"recursions_per_block": 1},
    "mor_off": {"mor_enabled": False},
    "two_recursions_capacity_half": {"recursions_per_block": 2, "mor_capacities": (1.0, 0.5)},
    "moe_loss_free_expert_choice": {
        "moe_enabled": True,
        "moe_num_experts": 4,
        "moe_balancing": "loss_free",
        "routing": "expert_choice",
    },
}


def randomise_routing_state(model, seed: int) -> None:
    """Thresholds near the middle of the router logits' range, random loss-free biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for thr in model.router_thresholds():
            thr.tau.fill_(float(torch.randn((), generator=g)) * 0.4)
            thr.seen.fill_(1.0)
        for moe in model.moe_layers():
            moe.balance_bias.copy_(torch.randn(moe.n_experts, generator=g) * 0.1)


def export_and_load(model, folder: Path):
    save = folder / "saved"
    model.save_pretrained(save)
    export_hf(save, folder / "hf")
    loaded, info = AutoModelForCausalLM.from_pretrained(
        folder / "hf", trust_remote_code=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return loaded.eval()


def assert_same_model(model, loaded, tokens: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        ours = model(tokens).logits
        theirs = loaded(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=2e-5)
    prompt = tokens[:1, :6]
    expected = model.generate(prompt, 12)
    got = loaded.generate(prompt, max_new_tokens=12, do_sample=False)
    assert got.tolist() == expected.tolist()


def routing_took_some_and_left_some(model, tokens: torch.Tensor) -> bool:
    model.eval()
    with torch.no_grad():
        model(tokens)
    stats = model.routing_stats()
    fracs = [float(s["selected_frac"]) for s in stats["mod"]]
    fracs += [float(d) for s in stats["mor"] for d in s["depth_hist"][1:-1]]  # tokens stopping early
    return any(0.0 < f < 1.0 for f in fracs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exported_model_matches_hydra_model(tmp_path, name):
    model = small_model(seed=3, **CONFIGS[name])
    randomise_routing_state(model, seed=len(name))
    tokens = random_tokens(2, 40, seed=7)
    if name not in ("routing_off", "static", "mod_off_one_recursion"):
        assert routing_took_some_and_left_some(model, tokens), (
            "routing is trivial here: the test would not test it"
        )
    loaded = export_and_load(model, tmp_path)
    assert type(loaded).__name__ == "HydraForCausalLM"
    assert_same_model(model, loaded, tokens)
    if name == "causal":  # nn.Module's own machinery (.to, .float) works on the loaded model
        with torch.no_grad():
            wide = loaded.to(torch.float64)(tokens).logits
        torch.testing.assert_close(wide.float(), model(tokens).logits, rtol=1e-4, atol=1e-4)


def test_a_size_preset_exports(tmp_path):
    torch.manual_seed(0)
    model = create_ccgqa_mod_mor_model("tiny", vocab_size=97, max_seq_len=64)
    randomise_routing_state(model, seed=1)
    loaded = export_and_load(model, tmp_path)
    assert_same_model(model, loaded, random_tokens(2, 48, seed=2))


def test_the_comparison_sees_the_saved_thresholds(tmp_path):
    """Moving one routing point's threshold in the loaded model changes its logits: the equality
    above depends on the exported routing state, not only on the weights."""
    model = small_model(seed=5)
    randomise_routing_state(model, seed=5)
    loaded = export_and_load(model, tmp_path)
    tokens = random_tokens(2, 40, seed=8)
    with torch.no_grad():
        before = loaded(tokens).logits
        loaded.blocks[1].causal.threshold.tau.add_(0.5)
        after = loaded(tokens).logits
    assert not torch.allclose(before, after, atol=1e-4)


def test_config_json_names_the_model_type_and_the_shipped_code(tmp_path):
    model = small_model(seed=1)
    model.save_pretrained(tmp_path / "saved")
    result = export_hf(tmp_path / "saved", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == result.model_type == "hydra_ccgqa"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_hydra.HydraForCausalLM"
    assert cfg["hydra"] == model.config.to_dict()
    assert cfg["layout"] == json.loads(json.dumps(hydra_layout(model)))
    for name in REMOTE_CODE_FILES:
        assert (tmp_path / "hf" / name).read_text() == (REMOTE_CODE_DIR / name).read_text()
    assert AutoConfig.from_pretrained(tmp_path / "hf", trust_remote_code=True).model_type == "hydra_ccgqa"
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["use_cache"] is False and gen["do_sample"] is False


def test_shipped_code_imports_only_torch_transformers_and_itself():
    allowed = {"torch", "transformers", "math", "__future__"}
    for name in REMOTE_CODE_FILES:
        tree = ast.parse((REMOTE_CODE_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                tops = set() if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert tops <= allowed, f"{name} imports {tops - allowed}"


_WITHOUT_HYDRA = r"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra_model", "hydra_kernels", "hydra_train", "hydra_diag", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: HYDRA is not installed here)")
        return None
sys.meta_path.insert(0, Refuse())
import torch
from transformers import AutoModelForCausalLM
folder, tokens_file, out_file = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokens = torch.load(tokens_file)
with torch.no_grad():
    logits = model(tokens).logits
assert not any(m.split(".")[0] in ("hydra_model", "hydra_kernels") for m in sys.modules)
generated = model.generate(tokens[:1, :5], max_new_tokens=8, do_sample=False)
torch.save({"logits": logits, "generated": generated}, out_file)
"""


def test_export_loads_where_hydra_is_not_installed(tmp_path):
    model = small_model(seed=2, moe_enabled=True, moe_num_experts=3)
    randomise_routing_state(model, seed=2)
    model.save_pretrained(tmp_path / "saved")
    export_hf(tmp_path / "saved", tmp_path / "hf")
    tokens = random_tokens(2, 32, seed=4)
    torch.save(tokens, tmp_path / "tokens.pt")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _WITHOUT_HYDRA,
            str(tmp_path / "hf"),
            str(tmp_path / "tokens.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(tokens).logits, rtol=1e-5, atol=2e-5)
    assert got["generated"].tolist() == model.generate(tokens[:1, :5], 8).tolist()


def test_right_padding_is_harmless_and_left_padding_refused(tmp_path):
    model = small_model(seed=4)
    randomise_routing_state(model, seed=4)
    loaded = export_and_load(model, tmp_path)
    tokens = random_tokens(2, 16)
    mask = torch.ones_like(tokens)
    mask[1, 10:] = 0  # the second sequence is 10 tokens long, padded on the right
    with torch.no_grad():
        padded = loaded(tokens, attention_mask=mask).logits
        alone = loaded(tokens[1:, :10]).logits
    torch.testing.assert_close(padded[1, :10], alone[0])
    with pytest.raises(ValueError, match="unpadded rows"):  # new tokens would follow the padding
        loaded.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False)
    mask[0, :3], mask[0, 3:] = 0, 1  # left padding
    with pytest.raises(ValueError, match="left padding"):
        loaded(tokens, attention_mask=mask)


def test_labels_give_the_shifted_cross_entropy(tmp_path):
    model = small_model(seed=6)
    loaded = export_and_load(model, tmp_path)
    tokens = random_tokens(2, 24, seed=9)
    with torch.no_grad():
        out = loaded(tokens, labels=tokens)
    logits = out.logits[:, :-1].double()
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-5)


def test_a_module_without_an_exported_implementation_is_refused(tmp_path):
    model = small_model(seed=1)
    model.blocks[1].mor.mode = "some_new_mode"
    with pytest.raises(UnsupportedModelError, match="some_new_mode"):
        hydra_layout(model)
    model = small_model(seed=1)
    model.blocks[0].mor.block.ffn = torch.nn.Identity()
    with pytest.raises(UnsupportedModelError, match="Identity"):
        hydra_layout(model)


def test_bfloat16_export_loads_and_generates(tmp_path):
    model = small_model(seed=7)
    randomise_routing_state(model, seed=7)
    model.save_pretrained(tmp_path / "saved")
    export_hf(tmp_path / "saved", tmp_path / "hf", dtype="bfloat16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert loaded.embed.weight.dtype == torch.bfloat16
    tokens = random_tokens(1, 24, seed=3)
    with torch.no_grad():
        logits = loaded(tokens).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())
    assert loaded.generate(tokens[:, :4], max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_one_recursion_without_a_router_exports_as_the_plain_residual_update(tmp_path):
    """A MoR block of one recursion without a router (what hydra_model may build) is laid out as
    the dense kind, h + block(h): the layout of a model with MoR switched off, which exports
    exactly (the "mor_off" configuration above)."""
    model = small_model(seed=8, recursions_per_block=1)
    for block in model.blocks:
        block.mor.router = None
    reference = small_model(seed=8, recursions_per_block=1, mor_enabled=False)
    assert hydra_layout(model) == hydra_layout(reference)
    assert {b["mor"]["kind"] for b in hydra_layout(model)["blocks"]} == {"dense"}
