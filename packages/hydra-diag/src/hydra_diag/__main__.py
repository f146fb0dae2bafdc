"""`python -m hydra_diag` runs the same app as the `hydra-diag` console script; a first argument that
names a tool of the seed's list (``python -m hydra_diag model_health_check``) runs that tool's command."""

import sys

from hydra_diag.cli import app
from hydra_kernels.cli_support import run_app


def _translate(argv: list[str]) -> list[str]:
    if argv and not argv[0].startswith("-"):
        from hydra_diag.tools import TOOLS, tool_argv

        names = {t.name for t in TOOLS}
        key = argv[0].removesuffix(".py").replace("-", "_")
        if key in names:
            return tool_argv(key, argv[1:])
    return argv


if __name__ == "__main__":
    sys.argv[1:] = _translate(sys.argv[1:])
    run_app(app, prog_name="hydra-diag")
