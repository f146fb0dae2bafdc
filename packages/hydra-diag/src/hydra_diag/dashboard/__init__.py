"""A live training dashboard in the browser over hydra-train's metrics database (``training.db``).

``hydra-diag dashboard CHECKPOINT_DIR`` serves one page (our own HTML/JS/CSS under ``static/``,
charts drawn by the plotly.js bundle that the ``plotly`` Python package ships) and a few JSON
endpoints. The page polls them every couple of seconds and appends the rows written since its
last poll, so it follows a ``hydra-train run`` as it writes.

Modules: :mod:`.store` reads the database (read-only, one short transaction per request, so the
trainer's writes never wait on it), :mod:`.safe_events` reads SafeOptimizations' event log,
:mod:`.server` is the HTTP server (stdlib ``ThreadingHTTPServer``).
"""

from hydra_diag.dashboard.store import DashboardStore, check_database

__all__ = ["DashboardStore", "check_database"]
