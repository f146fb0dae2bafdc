"""The dashboard opens the database the way hydra-train's readers do (metrics_schema.connect): a run
copied into a write-protected folder is served, a WAL database with no -wal beside it included."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import synthetic_db
from .dashboard_helpers import get_json, serving

ROW = dict(loss=3.0, lr=1e-3, grad_norm=1.0, ema_short=3.0, ema_medium=3.0, ema_long=3.0)


def _unprivileged(fn: Callable[[], Any]) -> Any:
    """``fn()`` as a user whom file modes stop: this one, or, for root (whom they do not stop, and
    the tests run as root), a forked child that becomes ``nobody``. Returns its JSON-able result;
    an exception in it comes back as its text."""
    if os.geteuid() != 0:
        return fn()
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("root, and no 'nobody' user to read as")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on, whatever happens only os._exit
        try:
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
            except OSError as exc:
                out = {"skip": f"cannot become nobody: {exc}"}
            else:
                try:
                    out = {"result": fn()}
                except BaseException as exc:
                    out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = json.loads(f.read() or b'{"error": "the child wrote nothing"}')
    os.waitpid(pid, 0)
    if "skip" in out:
        pytest.skip(out["skip"])
    assert "error" not in out, out["error"]
    return out["result"]


@contextlib.contextmanager
def _write_protected_wal_copy() -> Iterator[Path]:
    """A run's folder as a colleague's copy arrives: the database in WAL mode (its header says so)
    with no -wal or -shm beside it, file 0444, folder 0555. Under a 0755 folder of its own, since
    pytest's tmp_path is root's alone and ``nobody`` must reach it."""
    top = Path(tempfile.mkdtemp(prefix="hydra-dashboard-ro-"))
    folder = top / "copy"
    try:
        top.chmod(0o755)
        folder.mkdir()
        synthetic_db(folder, [dict(step=s, **ROW) for s in (1, 2)])
        assert sorted(p.name for p in folder.iterdir()) == ["training.db"]  # closed: WAL checkpointed
        assert (folder / "training.db").read_bytes()[18:20] == b"\x02\x02"  # WAL in the header
        (folder / "training.db").chmod(0o444)
        folder.chmod(0o555)
        yield folder
    finally:
        if folder.is_dir():
            folder.chmod(0o755)
        shutil.rmtree(top)


def test_a_write_protected_wal_copy_is_served():
    """SQLite cannot create the -shm a WAL reader needs there: mode=ro alone failed ('attempt to
    write a readonly database'); hydra-train's opening reads such a file immutable."""
    from hydra_diag.dashboard.store import DashboardStore

    # what DashboardStore.run imports on first use, imported here: nobody cannot read this venv
    for module in (
        "hydra_diag.dashboard.safe_events",
        "hydra_train.config",
        "hydra_train.safe_opts.registry",
    ):
        importlib.import_module(module)

    def read(folder: Path) -> Callable[[], Any]:
        def fn():
            store = DashboardStore(folder)
            return [r["run_id"] for r in store.runs()], [r["step"] for r in store.run("run1")["steps"]]

        return fn

    with _write_protected_wal_copy() as folder:
        assert _unprivileged(read(folder)) == [["run1"], [1, 2]]
        assert sorted(p.name for p in folder.iterdir()) == ["training.db"]


def test_a_database_gone_is_answered_503_naming_it(tmp_path):
    """hydra-train's opening says 'no metrics database' (HydraDataError): the server answers it
    as it does SQLite's errors (a rebuild in progress), not as an internal error."""
    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    with serving(tmp_path) as url:
        (tmp_path / "training.db").unlink()
        assert "no metrics database" in get_json(url + "api/runs", 503)["error"]
