"""hydra_diag: Diagnostics and benchmarks for HYDRA models, kernels and runs.

``hydra_diag.list_tools()`` lists the tools (the seed's script names) with their commands;
``hydra_diag.run_tool("model_health_check", **kwargs)`` runs one from Python and returns its
result dict (what ``--json`` prints). Nothing heavy is imported until a tool runs.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "list_tools", "run_tool"]


def list_tools() -> list[dict[str, Any]]:
    """Every tool: name, command, needs_cuda, description."""
    from hydra_diag.tools import list_tools as _list

    return _list()


def run_tool(name: str, **kwargs: Any) -> dict[str, Any]:
    """Run tool ``name`` with the keyword arguments of its library function; returns the result dict."""
    from hydra_diag.tools import run_tool as _run

    return _run(name, **kwargs)
