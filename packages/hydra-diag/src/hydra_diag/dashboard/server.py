"""The dashboard's HTTP server: the stdlib ``ThreadingHTTPServer``, nothing to install.

Routes (GET only)::

    /                          the page (static/index.html)
    /static/dashboard.{js,css} the page's own script and style
    /static/plotly.min.js      plotly.js, read from the installed ``plotly`` Python package
    /api/runs                  every run of the database, with its last logged step
    /api/run/<run_id>?steps=N&evals=N&...&max_rows=M
                               one run's rows after step N of each table (see store.INCREMENTAL),
                               thinned to about M rows a table when given (store.thin_by_step)

A request per poll is a few milliseconds of SQLite reads; a thread per connection keeps a slow
browser from holding up another.

Served on a loopback address (the default), a request must name a loopback host in its ``Host``
header (localhost, 127.x.y.z, [::1]): a web page from elsewhere whose domain an attacker points at
127.0.0.1 (DNS rebinding)
could otherwise read the run through the visitor's browser. Served on another address, the user has
chosen to expose the run and any ``Host`` is answered.
"""

from __future__ import annotations

import errno
import json
import socket
import sqlite3
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from hydra_diag.dashboard.store import INCREMENTAL, DashboardStore
from hydra_diag.output import DiagError

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}


def plotly_js() -> Path:
    """plotly.min.js as the ``plotly`` wheel installs it (no copy in our tree, no CDN)."""
    try:
        import plotly
    except ImportError:
        raise DiagError(
            "the dashboard draws its charts with plotly.js from the plotly package, which is not "
            "installed: pip install 'plotly>=5'"
        ) from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise DiagError(f"this plotly install ({plotly.__version__}) has no package_data/plotly.min.js")
    return path


def host_name(header: str) -> str:
    """The host of a ``Host`` header without its port, lower case: ``[::1]:8050`` → ``[::1]``."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: the port (if any) follows the bracket
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_loopback(host: str) -> bool:
    """Whether the address a server binds (or a Host header's name) is this machine only:
    localhost, ::1 or any 127.x.y.z (Debian names the machine 127.0.1.1)."""
    import ipaddress

    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a name, not an address
        return False


def static_files() -> dict[str, tuple[Path, str]]:
    """URL path → (file, content type) for everything the page loads."""
    own = resources.files("hydra_diag.dashboard") / "static"
    files = {"/": (Path(str(own / "index.html")), _TYPES[".html"])}
    for name in ("dashboard.js", "dashboard.css"):
        files[f"/static/{name}"] = (Path(str(own / name)), _TYPES[Path(name).suffix])
    files["/static/plotly.min.js"] = (plotly_js(), _TYPES[".js"])
    return files


class DashboardHandler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"  # keep-alive: the page's polls reuse one connection

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, ctype: str, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj, allow_nan=False).encode(), "application/json")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlparse(self.path)
        host = self.headers.get("Host")
        if self.server.loopback and host is not None and not is_loopback(host_name(host)):
            self._json(
                {"error": f"Host {host!r} is not this machine: open {self.server.url} (this server "
                 "answers only requests addressed to localhost, 127.x.y.z or [::1])"},
                403,
            )  # fmt: skip
            return
        try:
            if url.path in self.server.files:
                path, ctype = self.server.files[url.path]
                self._send(200, path.read_bytes(), ctype, cache=url.path.endswith(".min.js"))
            elif url.path == "/api/runs":
                self._json({"database": str(self.server.store.path), "runs": self.server.store.runs()})
            elif url.path.startswith("/api/run/"):
                self._run(unquote(url.path.removeprefix("/api/run/")), parse_qs(url.query))
            else:
                self._json({"error": f"no such page: {url.path}"}, 404)
        except (DiagError, sqlite3.Error) as exc:  # the database went away or is mid-rebuild
            self._json({"error": str(exc)}, 503)
        except (BrokenPipeError, ConnectionResetError):  # the browser left
            pass
        except Exception as exc:
            # a 500 that names it, not a dropped connection: the page shows the error and keeps
            # polling, and the server's log says what went wrong
            self.log_error("%s failed: %s", url.path, traceback.format_exc())
            self._json({"error": f"internal error serving {url.path}: {type(exc).__name__}: {exc}"}, 500)

    def _run(self, run_id: str, query: dict[str, list[str]]) -> None:
        since = {}
        for table in INCREMENTAL:
            try:
                since[table] = int(query.get(table, ["-1"])[0])
                if not -(2**63) <= since[table] < 2**63:  # beyond SQLite's INTEGER: OverflowError
                    raise ValueError
            except ValueError:
                self._json({"error": f"?{table}= takes a step number"}, 400)
                return
        max_rows = None
        if "max_rows" in query:
            try:
                max_rows = int(query["max_rows"][0])
                if max_rows < 1:
                    raise ValueError
            except ValueError:
                self._json({"error": "?max_rows= takes a positive number of rows"}, 400)
                return
        data = self.server.store.run(run_id, since, max_rows)
        if data is None:
            self._json({"error": f"no run {run_id!r} in {self.server.store.path}"}, 404)
        else:
            self._json(data)


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True  # Ctrl-C does not wait for open browser connections

    def __init__(self, store: DashboardStore, host: str, port: int, verbose: bool = False):
        self.store, self.verbose = store, verbose
        self.loopback = is_loopback(host)  # then only loopback Host headers are answered
        self.files = static_files()
        if not 0 <= port <= 65535:  # bind() raises OverflowError, not OSError, for these
            raise DiagError(f"--port {port} is not a TCP port: pick one in 1-65535 (0: any free port)")
        if ":" in host:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        try:
            super().__init__((host, port), DashboardHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DiagError(
                    f"port {port} on {host} is already in use (another dashboard?): pick a free one "
                    "with --port"
                ) from None
            raise DiagError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host if ':' not in str(host) else f'[{host}]'}:{port}/"
