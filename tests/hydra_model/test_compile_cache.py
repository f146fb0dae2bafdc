"""compile_cache.py: the SDPA context's functions named in torch's cacheable list once, keyed by
torch's version, without mutating the setting's previous dict."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config

from hydra_model.compile_cache import SDPA_CONTEXT_FUNCTIONS, vouch_for_sdpa_kernel_context


def test_the_sdpa_context_functions_are_named_once_in_a_new_dict():
    before = {"user.fn": "1"}
    # torch's own config patch, undone on exit (the naming done at import comes back with it)
    with inductor_config.patch(unsafe_marked_cacheable_functions=before):
        added = vouch_for_sdpa_kernel_context()
        names = [f"torch.nn.attention.{n}" for n in SDPA_CONTEXT_FUNCTIONS]
        assert added == names  # this torch has both
        after = inductor_config.unsafe_marked_cacheable_functions
        assert after is not before and before == {"user.fn": "1"}
        assert after == {"user.fn": "1", **{n: torch.__version__ for n in names}}
        assert vouch_for_sdpa_kernel_context() == []  # a second call adds nothing
        assert inductor_config.unsafe_marked_cacheable_functions is after
    assert set(names) <= set(inductor_config.unsafe_marked_cacheable_functions)
