"""Headless Chromium driven over the DevTools protocol on a pipe, for tests of web pages.

    with Browser(tmp_path) as browser:
        browser.open(url)
        browser.wait("document.querySelector('#runs tr') !== null")
        browser.click("#start")
        assert browser.eval("document.title") == "retrograd"

`--remote-debugging-pipe` makes Chromium read commands on its fd 3 and answer on its fd 4, each
a JSON message ended by a NUL byte: no websocket needed. One page is attached (flattened
session); `eval` runs JavaScript in it (promises awaited), `wait` polls a condition until a
deadline, `click` sends a real mouse press and release at an element's centre, `type` inserts
text into the focused field as a keyboard would.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
HEADLESS = (
    "--headless",
    "--no-sandbox",  # as root (CI containers) Chromium refuses to start without it
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.fail(
        "headless Chromium is needed to test the web pages and none of "
        f"{', '.join(BROWSERS)} is on PATH: `make browser` (scripts/browser.sh, run by "
        "`make test`) installs it where it can and says why where it cannot",
        pytrace=False,
    )


class BrowserError(AssertionError):
    pass


class Browser:
    def __init__(self, tmp: Path, size: tuple[int, int] = (1400, 1000)):
        self.tmp = Path(tmp)
        self.size = size
        self.proc: subprocess.Popen | None = None
        self.next_id = 0
        self.session: str | None = None
        self.buffer = b""
        self.events: list[dict] = []  # what the page logged: console messages and exceptions

    # -- the process --------------------------------------------------------------------

    def start(self) -> Browser:
        profile = self.tmp / f"chromium-profile-{os.getpid()}-{time.monotonic_ns()}"
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # the child's ends on fds 5 and up, so that moving them onto 3 and 4 clobbers neither
        child_in = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 5)
        child_out = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 5)
        os.close(to_child_r)
        os.close(from_child_w)

        def onto_3_and_4():
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        command = [
            chromium(),
            *HEADLESS,
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            f"--window-size={self.size[0]},{self.size[1]}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        env = os.environ | {"HOME": str(self.tmp)}  # crash reports and caches stay in tmp
        # Python's own descriptors are not inherited (PEP 446): only 3 and 4 reach Chromium
        self.proc = subprocess.Popen(  # noqa: PLW1509 - the hook only moves two descriptors
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "chromium.log", "ab"),  # noqa: SIM115
            env=env,
            close_fds=False,
            preexec_fn=onto_3_and_4,
        )
        os.close(child_in)
        os.close(child_out)
        self.write_fd, self.read_fd = to_child_w, from_child_r
        targets = self.call("Target.getTargets", timeout=60)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call(
            "Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}
        )["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        return self

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.call("Browser.close", timeout=10, session=False)
            self.proc.wait(timeout=10)
        except (BrowserError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        for fd in (self.write_fd, self.read_fd):
            os.close(fd)
        self.proc = None

    def __enter__(self) -> Browser:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the protocol -------------------------------------------------------------------

    def call(self, method: str, params: dict | None = None, timeout: float = 60, session=True):
        """Send one command and wait for its answer (events met meanwhile are kept)."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session is not None:
            message["sessionId"] = self.session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._event(reply)

    def _read(self, deadline: float) -> dict:
        import select

        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"Chromium did not answer in time; {self.log()}")
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if ready:
                chunk = os.read(self.read_fd, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed its pipe; {self.log()}")
                self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def _event(self, message: dict) -> None:
        method = message.get("method")
        params = message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.events.append({"console": params["type"], "text": text})
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.events.append({"exception": text})

    def log(self) -> str:
        path = self.tmp / "chromium.log"
        return "chromium log: " + (
            path.read_text(errors="replace")[-2000:] if path.exists() else ""
        )

    def errors(self) -> list[str]:
        """Exceptions the page threw and console errors it logged, so far."""
        return [
            e.get("exception") or e["text"]
            for e in self.events
            if "exception" in e or e.get("console") == "error"
        ]

    # -- what tests do ------------------------------------------------------------------

    def open(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait("document.readyState === 'complete'")

    def eval(self, expression: str, timeout: float = 60):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
            timeout=timeout,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(
                f"{expression}: {details.get('exception', {}).get('description') or details}"
            )
        return result["result"].get("value")

    def wait(self, condition: str, timeout: float = 60, every: float = 0.1):
        """Poll a JavaScript expression until it is truthy (an element or any object counts);
        its value. Fails past `timeout` with the last value and the page's errors."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(condition)
            if value is not None and value is not False and value != 0 and value != "":
                return value
            if time.monotonic() > deadline:
                text = self.eval("document.body ? document.body.innerText.slice(0, 3000) : ''")
                raise BrowserError(
                    f"waited {timeout:g} s for {condition}; last value {value!r}; "
                    f"page errors {self.errors()}; page text:\n{text}"
                )
            time.sleep(every)

    def click(self, selector: str, timeout: float = 30) -> None:
        """A mouse click at the centre of the first element matching `selector`, once it is
        shown and enabled."""
        found = json.dumps(selector)
        box = self.wait(
            f"""(() => {{
                const e = document.querySelector({found});
                if (!e || e.disabled) return null;
                e.scrollIntoView({{block: 'center'}});
                const r = e.getBoundingClientRect();
                return r.width && r.height ? [r.x + r.width / 2, r.y + r.height / 2] : null;
            }})()""",
            timeout,
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
            )

    def type(self, selector: str, text: str) -> None:
        """Focus the field and insert `text` as typed (input events fire)."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", {"text": text})

    def save_downloads(self, folder: Path) -> None:
        """Downloads go to `folder` under the names the server gives them."""
        folder.mkdir(parents=True, exist_ok=True)
        self.call(
            "Browser.setDownloadBehavior",
            {"behavior": "allow", "downloadPath": str(folder)},
            session=False,
        )

    def choose_file(self, selector: str, path: Path) -> None:
        """Put a file in a file input, as the file picker would."""
        root = self.call("DOM.getDocument")["root"]["nodeId"]
        node = self.call("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
        self.call("DOM.setFileInputFiles", {"nodeId": node, "files": [str(path)]})

    def text(self, selector: str) -> str:
        return self.eval(
            f"(document.querySelector({json.dumps(selector)}) || {{innerText: ''}}).innerText"
        )
