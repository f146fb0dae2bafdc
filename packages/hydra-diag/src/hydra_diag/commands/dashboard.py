"""``hydra-diag dashboard``: the live training dashboard (hydra_diag/dashboard/)."""

from typing import Annotated

import typer

from hydra_diag.cliutil import opt
from hydra_kernels.cli_support import console, err_console, fail


def dashboard_cmd(
    checkpoint_dir: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT_DIR",
            help="The run's --checkpoint_dir (it holds training.db), or the database file.",
        ),
    ] = "checkpoints",
    port: Annotated[
        int, opt("--port", help="TCP port to serve on (0: any free one).", min=0, max=65535)
    ] = 8050,
    host: Annotated[
        str,
        opt(
            "--host",
            help="Address to bind. The default serves this machine only: no authentication, and only "
            "requests addressed to localhost, 127.x.y.z or [::1] are answered.",
        ),
    ] = "127.0.0.1",
    log_requests: Annotated[bool, opt("--log_requests", help="Print every HTTP request on stderr.")] = False,
) -> None:
    """Serve a live dashboard of training.db in the browser: losses and their EMAs, learning rate,
    gradient norm, tokens/s, memory, MoD/MoR/MoE routing per layer, SafeOptimizations status and
    anomalies, skipped steps; pick and compare runs. It follows a `hydra-train run` as it writes
    (the page polls every 2 s) and only ever reads the database. Ctrl-C stops it."""
    from hydra_diag.dashboard.server import DashboardServer, is_loopback
    from hydra_diag.dashboard.store import DashboardStore
    from hydra_diag.output import DiagError

    try:
        store = DashboardStore(checkpoint_dir)
        server = DashboardServer(store, host, port, verbose=log_requests)
    except DiagError as exc:
        fail(str(exc))
    if not is_loopback(host):
        err_console.print(
            f"warning: serving on {host}: anyone who can reach it sees the run", highlight=False
        )
    console.print(
        f"dashboard of {store.path} at {server.url} (Ctrl-C stops it)", highlight=False, soft_wrap=True
    )
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
