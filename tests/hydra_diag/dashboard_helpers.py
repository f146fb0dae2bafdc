"""What the dashboard tests share: a server on a free 127.0.0.1 port in a thread, JSON GETs, and
the database read directly (the reference the endpoints are checked against)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def serving(path: str | Path) -> Iterator[str]:
    """The dashboard of ``path`` served from a thread; yields its base URL."""
    from hydra_diag.dashboard.server import DashboardServer
    from hydra_diag.dashboard.store import DashboardStore

    server = DashboardServer(DashboardStore(path), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def get(url: str) -> tuple[int, bytes, str]:
    """Status, body and content type of a GET (errors included, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def get_json(url: str, status: int = 200) -> Any:
    code, body, ctype = get(url)
    assert code == status, body[:500]
    assert ctype == "application/json"
    return json.loads(body)


def db_rows(db: Path, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    """Rows straight from SQLite (a plain connection, not the dashboard's code)."""
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params)]
    finally:
        conn.close()
