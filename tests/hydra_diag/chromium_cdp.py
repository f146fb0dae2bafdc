"""Headless Chromium driven over the DevTools protocol (a small client on ``websocket-client``):
load a page, evaluate JavaScript in it, take a PNG screenshot. Test tooling for the dashboard.

The browser is the system's (Debian's ``chromium`` package; ``.ci/run`` installs it), or the one
``HYDRA_CHROMIUM`` names; nothing is ever downloaded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The Chromium executable to use, or None when this machine has none."""
    if os.environ.get("HYDRA_CHROMIUM"):
        return shutil.which(os.environ["HYDRA_CHROMIUM"])
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


class Page:
    """One browser tab over its DevTools websocket; ``call`` sends a command and waits for its answer."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events arrive in between; skip them
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JavaScript error: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, poll: float = 0.2) -> Any:
        """Evaluate ``expression`` until it is truthy; its value, or TimeoutError."""
        end = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"still false after {timeout:.0f} s: {expression}")
            time.sleep(poll)

    def navigate(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@contextlib.contextmanager
def headless_chromium(profile_dir: Path, width: int = 1400, height: int = 1700) -> Iterator[Page]:
    """A headless Chromium on a fresh profile, with one page; closed on exit."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set HYDRA_CHROMIUM)")
    profile_dir.mkdir(parents=True, exist_ok=True)
    port_file = profile_dir / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)
    args = [
        exe,
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",  # any free port; Chromium writes it to DevToolsActivePort
        "--remote-allow-origins=*",
        f"--user-data-dir={profile_dir}",
        f"--window-size={width},{height}",
        "about:blank",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"chromium exited ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}"
                )
            if time.monotonic() > end:
                raise TimeoutError("chromium did not open its DevTools port within 60 s")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = json.load(r)
        tab = next(t for t in targets if t.get("type") == "page")
        page = Page(tab["webSocketDebuggerUrl"])
        page.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        # no scrollbar: a full-page capture lays the page out at the width the charts were drawn at
        page.call("Emulation.setScrollbarsHidden", hidden=True)
        try:
            yield page
        finally:
            page.ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
