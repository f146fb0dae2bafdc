"""What keeps HYDRA's compiled graphs in torch's AOTAutograd cache, so that a warm
``torch.compile`` of a model loads its forward and backward instead of tracing them again.

torch refuses to cache a graph holding a call it has not vetted. HYDRA's traced code avoids the
ones it can (no autocast context inside the traced router logits, a custom op for the routed
gather: fused_routing.py, routing.py); what is left is torch's own ``sdpa_kernel`` context around
a restricted SDPA pick (attention_backend.py; run by attention_impls.py), vouched for here. A CPU
test runs torch's check on HYDRA's traced graphs (tests/hydra_model/test_model.py); the measured
effect is in packages/hydra-train/BENCHMARKS.md.
"""

from __future__ import annotations

import torch

#: the functions a traced ``torch.nn.attention.sdpa_kernel`` context leaves in a graph: a
#: backend's name to its enum, and the switch of the allowed kernels
SDPA_CONTEXT_FUNCTIONS = ("_backend_from_string", "_sdpa_kernel")


def vouch_for_sdpa_kernel_context() -> list[str]:
    """Name the SDPA context's functions in torch's ``unsafe_marked_cacheable_functions`` (keyed
    by torch's version, as that setting asks) and return the names added. Both are pure functions
    of their arguments, which the cache key hashes with the graph, and their effect is fixed into
    the attention op the trace records, so a cached graph is the graph a new trace would give.
    Without them torch bypassed its cache for such a graph (found for an fp32 training forward on
    an H100, where auto picked a restricted kernel)."""
    import torch._inductor.config as inductor_config
    import torch.nn.attention as attention

    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if not isinstance(marked, dict):  # pragma: no cover - a torch without the setting
        return []
    names = [f"torch.nn.attention.{n}" for n in SDPA_CONTEXT_FUNCTIONS if hasattr(attention, n)]
    added = [n for n in names if n not in marked]
    if added:  # a new dict, so that the setting's default object is left as it was
        inductor_config.unsafe_marked_cacheable_functions = {
            **marked,
            **{n: torch.__version__ for n in added},
        }
    return added
