"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

Shared by the HTML report's browser test and its benchmark. The browser is Debian's ``chromium``;
commands go in on file descriptor 3 and replies come back on 4, NUL-separated JSON, so no
websocket, port or extra package is needed. It records what a person would notice: console
errors, uncaught exceptions, requests that failed or were blocked.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageLoad:
    """What opening one page showed."""

    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    seconds_to_drawn: float = 0.0
    drawn_at_ms: float = 0.0


class Chromium:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, *, width: int = 1200, height: int = 900, timeout: float = 60.0) -> None:
        binary = chromium_path()
        if binary is None:
            raise RuntimeError("chromium is not installed: apt-get install chromium")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="wmwatch-chromium-")
        cmd_read, self._cmd_write = os.pipe()
        self._reply_read, reply_write = os.pipe()
        # the child must find the pipes on fds 3 and 4: take copies above them first (closed
        # on exec), which the child moves onto 3 and 4 (dup2 makes those inheritable)
        high_cmd = fcntl.fcntl(cmd_read, fcntl.F_DUPFD_CLOEXEC, 10)
        high_reply = fcntl.fcntl(reply_write, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(cmd_read)
        os.close(reply_write)

        def _fds() -> None:
            os.dup2(high_cmd, 3)
            os.dup2(high_reply, 4)

        self._proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--remote-debugging-pipe",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--hide-scrollbars",
                "--font-render-hinting=none",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # every fd Python opens is non-inheritable (PEP 446): only 0-4 reach the browser
            close_fds=False,
            preexec_fn=_fds,
        )
        os.close(high_cmd)
        os.close(high_reply)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.width, self.height = width, height
        target = self._call("Target.getTargets")["targetInfos"]
        page = next(t for t in target if t["type"] == "page")
        self._session = self._call(
            "Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}
        )["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    # -- protocol ---------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        os.write(self._cmd_write, json.dumps(message).encode() + b"\0")

    def _receive(self, deadline: float) -> dict[str, Any]:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self._reply_read], [], [], left)
            if ready:
                chunk = os.read(self._reply_read, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def _call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._send(message)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self._events.append(reply)

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._call(method, params, self._session)

    def _wait_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            for index, event in enumerate(self._events):
                if event["method"] == method:
                    return self._events.pop(index)
            reply = self._receive(deadline)
            if "method" in reply:
                self._events.append(reply)

    # -- what a test uses -------------------------------------------------------------------------

    def open(self, path: Path) -> PageLoad:
        """Open ``path`` and wait until it has loaded and painted twice."""
        self._events.clear()
        started = time.perf_counter()
        self.call("Page.navigate", {"url": path.resolve().as_uri()})
        self._wait_event("Page.loadEventFired")
        drawn = self.evaluate(
            "new Promise(r => requestAnimationFrame(() => requestAnimationFrame("
            "() => r(performance.now()))))"
        )
        load = PageLoad(seconds_to_drawn=time.perf_counter() - started, drawn_at_ms=float(drawn))
        for event in self._events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = params.get("args", [])
                load.console_errors.append(" ".join(str(a.get("value", a)) for a in args))
            elif method == "Runtime.exceptionThrown":
                load.console_errors.append(str(params["exceptionDetails"].get("text")))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                load.console_errors.append(str(params["entry"].get("text")))
            elif method == "Network.requestWillBeSent":
                load.requests.append(str(params["request"]["url"]))
            elif method == "Network.loadingFailed":
                load.failed_requests.append(
                    f"{params.get('errorText')} {params.get('blockedReason') or ''}".strip()
                )
        self._events.clear()
        return load

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, target: Path) -> tuple[int, int]:
        """A PNG of the whole page (not only the viewport); returns its (width, height)."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        data = self.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": self.width, "height": height, "scale": 1},
            },
        )["data"]
        target.write_bytes(base64.b64decode(data))
        return self.width, height

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self._call("Browser.close")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        for fd in (self._cmd_write, self._reply_read):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
