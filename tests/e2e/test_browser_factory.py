"""The browser the web-page tests drive (tests/factories/browser.py) waits for events, not for
time: a click the page moved away from is given again until the page's click event reaches the
element, a download is over when Chromium says so, and a wait that never comes true fails with
the page's text once its deadline passes."""

from __future__ import annotations

import functools
import http.server
import threading
import time

import pytest

from tests.factories.browser import Browser, BrowserError

# The button jumps away at the first press (as a page re-rendering under the pointer would):
# the release lands elsewhere and the click event goes to the page, not to the button.
PAGE = """<!doctype html>
<button id="go" style="position: absolute; left: 20px; top: 20px; width: 120px; height: 40px">
  go</button>
<a id="get" href="data.bin" download="saved.bin">get</a>
<p id="out"></p>
<script>
  const go = document.getElementById("go");
  let presses = 0;
  go.addEventListener("mousedown", () => {
    if (presses++ === 0) go.style.top = "400px";
  });
  go.addEventListener("click", () => (document.getElementById("out").textContent = "clicked"));
</script>
"""


@pytest.fixture
def site(tmp_path):
    """A folder served over HTTP on 127.0.0.1; yields its base URL."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "index.html").write_text(PAGE)
    (root / "data.bin").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_click_the_page_moved_away_from_is_given_again(site, tmp_path):
    with Browser(tmp_path) as browser:
        browser.open(site)
        browser.click("#go")
        assert browser.text("#out") == "clicked"  # no wait: the click was confirmed
        assert browser.eval("presses") == 2  # the first press missed, the second landed


def test_a_download_ends_on_chromiums_completed_event(site, tmp_path):
    with Browser(tmp_path) as browser:
        browser.open(site)
        browser.save_downloads(tmp_path / "downloads")
        saved = browser.download("#get")
        assert saved == tmp_path / "downloads" / "saved.bin"
        assert saved.read_bytes() == (tmp_path / "site" / "data.bin").read_bytes()
        progress = [e["params"] for e in browser.received if e["method"].startswith("Browser.")]
        assert progress[-1]["state"] == "completed"
        assert progress[-1]["receivedBytes"] == 1 << 20


def test_a_wait_that_never_comes_true_fails_with_the_page_text(site, tmp_path):
    with Browser(tmp_path) as browser:
        browser.open(site)
        start = time.monotonic()
        with pytest.raises(BrowserError, match=r"waited 1 s for .*last value 0.*page text:\s+go"):
            browser.wait("document.querySelectorAll('#nowhere').length", timeout=1)
        assert time.monotonic() - start >= 1
        # a change the DOM announces ends a wait as soon as it happens
        browser.eval("setTimeout(() => document.body.append('later'), 200)")
        assert browser.wait("document.body.innerText.includes('later')", timeout=30)
