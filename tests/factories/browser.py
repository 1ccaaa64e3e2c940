"""Headless Chromium driven over the DevTools protocol on a pipe, for tests of web pages.

    with Browser(tmp_path) as browser:
        browser.open(url)
        browser.wait("document.querySelector('#runs tr') !== null")
        browser.click("#start")
        assert browser.eval("document.title") == "retrograd"

`--remote-debugging-pipe` makes Chromium read commands on its fd 3 and answer on its fd 4, each
a JSON message ended by a NUL byte: no websocket needed. One page is attached (flattened
session); `eval` runs JavaScript in it (promises awaited), `wait` waits for a condition inside
the page (woken by the page's own changes), `click` sends a real mouse press and release at an
element's centre and confirms the page's click event reached that element, `type` inserts text
into the focused field as a keyboard would, `download` clicks and waits for Chromium's own
download events.

NOTE: every wait here ends on an event (a protocol event, a DOM mutation, a click listener),
never on a guess of how long something takes: the suite runs beside training runs and other
processes, and a loaded machine stretches every step. The deadlines only bound a failure.
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
        self.received: list[dict] = []  # every protocol event, in order (see wait_event)
        self.downloads: Path | None = None

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
        if method is None:
            return  # the late answer of a command given up on
        params = message.get("params", {})
        self.received.append({"method": method, "params": params})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.events.append({"console": params["type"], "text": text})
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.events.append({"exception": text})

    def wait_event(self, method: str, match=None, since: int = 0, timeout: float = 60) -> dict:
        """The parameters of the first event `method` received at or after index `since` of
        `self.received` for which `match(params)` holds (any, without `match`), reading the
        pipe until it comes."""
        deadline = time.monotonic() + timeout
        seen = since
        while True:
            for event in self.received[seen:]:
                if event["method"] == method and (match is None or match(event["params"])):
                    return event["params"]
            seen = len(self.received)
            try:
                message = self._read(deadline)
            except BrowserError as e:
                raise BrowserError(f"no {method} event in {timeout:g} s; {e}") from None
            self._event(message)

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

    def open(self, url: str, timeout: float = 60) -> None:
        """Navigate, and return once the page's load event has fired."""
        since = len(self.received)
        result = self.call("Page.navigate", {"url": url}, timeout=timeout)
        if "errorText" in result:
            raise BrowserError(f"{url}: {result['errorText']}")
        if "loaderId" in result:  # a new document (a fragment change has none and no load)
            self.wait_event("Page.loadEventFired", since=since, timeout=timeout)

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

    def wait(self, condition: str, timeout: float = 60):
        """Wait until a JavaScript expression is truthy (an element or any object counts); its
        value. The page tests it again at each change of its DOM, its address's fragment or its
        ready state, and every RECHECK_MS for what changes without a DOM event (a field's value,
        storage). Fails past `timeout` with the last value, the page's errors and its text."""
        result = self.eval(
            WAIT.replace("CONDITION", condition).replace("TIMEOUT_MS", str(int(timeout * 1000))),
            timeout=timeout + 60,  # the page's own timer ends the wait; this only bounds a hang
        )
        if result["ok"]:
            return result["value"]
        text = self.eval("document.body ? document.body.innerText.slice(0, 3000) : ''")
        raise BrowserError(
            f"waited {timeout:g} s for {condition}; last value {result['value']!r}; "
            f"page errors {self.errors()}; page text:\n{text}"
        )

    def click(self, selector: str, timeout: float = 30) -> None:
        """A mouse click at the centre of the first element matching `selector`, once it is
        shown and enabled, confirmed by the page: its click event reached an element matching
        `selector` (or one inside it). A page that re-rendered between the measure and the
        press (the click hit nothing that matches) gets the click again."""
        found = json.dumps(selector)
        deadline = time.monotonic() + timeout
        while True:
            box = self.wait(
                f"""(() => {{
                    const e = document.querySelector({found});
                    if (!e || e.disabled) return null;
                    e.scrollIntoView({{block: 'center'}});
                    const r = e.getBoundingClientRect();
                    return r.width && r.height ? [r.x + r.width / 2, r.y + r.height / 2] : null;
                }})()""",
                max(deadline - time.monotonic(), 1),
            )
            self.eval(LISTEN_CLICK.replace("SELECTOR", found))
            for kind in ("mousePressed", "mouseReleased"):
                # NOTE: the call answers once the page has handled the event, so a click
                # event, if any, has been dispatched by then
                self.call(
                    "Input.dispatchMouseEvent",
                    {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
                )
            hit = self.eval("window.__retrogradClick")
            if hit is not None and hit["reached"]:
                return
            if time.monotonic() > deadline:
                raise BrowserError(
                    f"click on {selector} at {box}: the page's click event "
                    + (f"reached {hit['target']} instead" if hit else "never came")
                    + f"; page errors {self.errors()}"
                )

    def type(self, selector: str, text: str) -> None:
        """Focus the field and insert `text` as typed (input events fire)."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", {"text": text})

    def save_downloads(self, folder: Path) -> None:
        """Downloads go to `folder` under the names the server gives them, and report their
        progress as events (see `download`)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.call(
            "Browser.setDownloadBehavior",
            {"behavior": "allow", "downloadPath": str(folder), "eventsEnabled": True},
            session=False,
        )
        self.downloads = folder

    def download(self, selector: str, timeout: float = 60) -> Path:
        """Click `selector` and wait for the download it starts to complete (Chromium's
        Browser.downloadWillBegin, then Browser.downloadProgress with state "completed"); the
        saved file. Needs `save_downloads` first."""
        assert self.downloads is not None, "call save_downloads(folder) first"
        since = len(self.received)
        self.click(selector, timeout)
        try:
            begun = self.wait_event("Browser.downloadWillBegin", since=since, timeout=timeout)
        except BrowserError as e:
            text = self.eval("document.body ? document.body.innerText.slice(0, 3000) : ''")
            raise BrowserError(f"{e}; page errors {self.errors()}; page text:\n{text}") from None
        done = self.wait_event(
            "Browser.downloadProgress",
            lambda p: p["guid"] == begun["guid"] and p["state"] in ("completed", "canceled"),
            since=since,
            timeout=timeout,
        )
        if done["state"] != "completed":
            raise BrowserError(f"the download of {begun['url']} was canceled")
        return self.downloads / begun["suggestedFilename"]

    def choose_file(self, selector: str, path: Path) -> None:
        """Put a file in a file input, as the file picker would."""
        root = self.call("DOM.getDocument")["root"]["nodeId"]
        node = self.call("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
        self.call("DOM.setFileInputFiles", {"nodeId": node, "files": [str(path)]})

    def text(self, selector: str) -> str:
        return self.eval(
            f"(document.querySelector({json.dumps(selector)}) || {{innerText: ''}}).innerText"
        )


# Resolves when CONDITION is truthy ({ok: true, value}) or after TIMEOUT_MS ({ok: false, value:
# the last value}); an exception in CONDITION rejects (Runtime.evaluate reports it).
RECHECK_MS = 250
WAIT = """new Promise((resolve, reject) => {
    let last;
    const truthy = (v) => v !== null && v !== undefined && v !== false && v !== 0 && v !== "";
    const observer = new MutationObserver(() => test());
    const stop = () => {
        observer.disconnect();
        clearInterval(recheck);
        clearTimeout(limit);
        window.removeEventListener("hashchange", test);
        document.removeEventListener("readystatechange", test);
    };
    function test() {
        try {
            last = (CONDITION);
        } catch (error) {
            stop();
            reject(error);
            return;
        }
        if (truthy(last)) {
            stop();
            resolve({ok: true, value: last});
        }
    }
    observer.observe(document, {subtree: true, childList: true, attributes: true,
                                characterData: true});
    window.addEventListener("hashchange", test);
    document.addEventListener("readystatechange", test);
    const recheck = setInterval(test, RECHECK_MS);
    const limit = setTimeout(() => { stop(); resolve({ok: false, value: last}); }, TIMEOUT_MS);
    test();
})""".replace("RECHECK_MS", str(RECHECK_MS))

# Records where the next click event lands: whether its target is, or is inside, an element
# matching SELECTOR, and a short description of the target otherwise.
LISTEN_CLICK = """(() => {
    window.__retrogradClick = null;
    document.addEventListener("click", (event) => {
        const t = event.target;
        window.__retrogradClick = {
            reached: t instanceof Element && t.closest(SELECTOR) !== null,
            target: t instanceof Element ? t.outerHTML.slice(0, 200) : String(t),
        };
    }, {capture: true, once: true});
})()"""
