"""A minimal headless-Chromium driver over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` makes Chromium read protocol commands from file descriptor 3 and
write replies and events to descriptor 4, as NUL-terminated JSON: no port, no websocket
library, nothing but the browser Debian packages. Used by tests/test_viz_html.py.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
    "--window-size=1280,900",
]


def find_browser() -> str | None:
    """``$QKV_CHROMIUM``, else the first of chromium / chromium-browser / google-chrome."""
    env = os.environ.get("QKV_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Chromium:
    """``with Chromium(path) as b: b.open(url); b.eval("1+1"); b.screenshot()``."""

    def __init__(self, path: str, *, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="qkv-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire() -> None:  # in the child: the protocol pipe at fds 3 (in) and 4 (out)
            # Move both ends above 10 first: a pipe end may already sit at 3 or 4, and
            # dup2(fd, fd) would neither move it nor make it survive exec.
            hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        # stderr to a file, not a pipe: Chromium is chatty and a full pipe would block it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [path, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            preexec_fn=wire,
            close_fds=False,  # our other fds are non-inheritable (PEP 446); 3 and 4 are dup2'd
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None
        try:
            targets = self.send("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            self.session = self.send(
                "Target.attachToTarget", targetId=page["targetId"], flatten=True, session=False
            )["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.send(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def stderr(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    # -------------------------------------------------------------------- protocol plumbing

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("Chromium did not answer in time")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 16)
                if not chunk:
                    raise BrowserError(f"Chromium exited: {self.stderr().strip()[-2000:]}")
                self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, *, session: bool = True, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._on_event(reply)

    def _on_event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        if ev.get("method") == "Page.javascriptDialogOpening":  # e.g. an injected alert()
            self.send("Page.handleJavaScriptDialog", accept=True)

    def wait_for(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        for ev in self.events:
            if ev.get("method") == method:
                return ev
        while True:
            ev = self._read_message(deadline)
            if "id" not in ev:
                self._on_event(ev)
                if ev.get("method") == method:
                    return ev

    # ----------------------------------------------------------------------------- helpers

    def open(self, url: str) -> None:
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression!r} raised: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, failed loads and dialogs seen so far."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(
                    f"exception: {p['exceptionDetails'].get('text')} {p['exceptionDetails']}"
                )
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Page.javascriptDialogOpening":
                out.append(f"dialog: {p.get('type')} {p.get('message')!r}")
        return out

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", session=False)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            os.close(fd)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def started() -> Iterator[Chromium]:
    """A Chromium for a test module (its ``browser`` fixture yields from this), closed after
    it; without one the test fails with how to get it (or skips with QKV_SKIP_BROWSER=1
    outside CI)."""
    import pytest

    def unavailable(why: str) -> None:
        if os.environ.get("QKV_SKIP_BROWSER") == "1" and not os.environ.get("CI"):
            pytest.skip(f"{why} (skipped: QKV_SKIP_BROWSER=1 outside CI)")
        pytest.fail(
            f"{why}. `make test` installs Chromium as root (apt-get install chromium); outside "
            f"CI you may skip these tests with QKV_SKIP_BROWSER=1",
            pytrace=False,
        )

    path = find_browser()
    if path is None:
        unavailable("no Chromium found ($QKV_CHROMIUM, chromium, chromium-browser)")
    assert path is not None
    try:
        b = Chromium(path)
    except (BrowserError, OSError) as e:
        unavailable(f"Chromium at {path} did not start: {e}")
        raise
    b.send("Network.enable")
    try:
        yield b
    finally:
        b.close()
