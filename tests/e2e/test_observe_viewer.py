"""The rollout viewer in a real browser: headless Chromium opens an observe directory's index.html
from disk (file://, no server), runs its scripts, and we read the DOM it built and its screenshot.

Chromium is a system package (`make test` installs it through scripts/browser.sh where it can).
A machine without it fails here with that instruction rather than skipping the test.
"""

from __future__ import annotations

import html as html_lib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from retrograd.config.tracking import ObserveSection
from retrograd.observe.rollouts import ObserveWriter
from tests.factories.browser import HEADLESS, chromium
from tests.factories.rollouts import finish_update, make_groups, write_run

HOSTILE = "<b>not bold</b> & ünïcödé ✓"


def browse(url: str, tmp_path: Path, *args: str) -> str:
    """Run headless Chromium on `url` for 5 s of virtual time; its stdout."""
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    command = [
        chromium(),
        *HEADLESS,
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        "--virtual-time-budget=5000",
        *args,
        url,
    ]
    env = os.environ | {"HOME": str(tmp_path)}  # crash reports and caches stay in tmp
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture(scope="module")
def observe_dir(tmp_path_factory) -> Path:
    """Updates 1-6 (texts on even ones), then update 8 of a run resumed from update 6 whose
    last answer holds markup that must show as text."""
    directory = tmp_path_factory.mktemp("observe")
    write_run(directory, range(1, 8), every=2)
    writer = write_run(directory, range(7, 8), every=1, resumed_from_update=6)
    assert writer.dropped_batches == 0
    with ObserveWriter.open(
        ObserveSection(directory=directory),
        algorithm="grpo",
        model="models/tiny.gguf",
        params={},
        resumed_from_update=7,
    ) as writer:
        groups = make_groups(8)
        groups[1].members[2].text = HOSTILE
        writer.rollouts(8, groups)
        finish_update(groups)
        writer.outcome(8, groups)
        writer.update(8, "completed", {"reward/mean": 0.6, "policy/kl": 0.05})
    return directory


def page(directory: Path) -> str:
    return (directory / "index.html").as_uri()


def classes(dom: str, name: str) -> list[str]:
    """The opening tags whose class list holds `name`."""
    return re.findall(rf'<[a-z0-9]+ [^>]*class="(?:[^"]* )?{name}(?: [^"]*)?"[^>]*>', dom)


def test_viewer_renders_curves_updates_and_groups(observe_dir, tmp_path):
    dom = browse(page(observe_dir), tmp_path, "--dump-dom")
    assert "grpo · models/tiny.gguf · resumed 2×" in dom
    # Four curves, each a line through the updates.
    assert len(classes(dom, "curve")) == 4
    assert dom.count('class="line"') == 4
    # Every update listed once (the replayed update 7 only from its later segment).
    rows = re.findall(r'<tr class="[^"]*" data-update="(\d+)"', dom)
    assert rows == ["8", "7", "6", "5", "4", "3", "2", "1"]
    # The newest update with texts is open: its three groups, sorted by mean reward.
    assert "update 8 · completed · 3 groups" in dom
    groups = re.findall(r'<article class="group[^"]*" data-group="(\d)"', dom)
    means = {g: sum(r.reward for r in make_groups(8)[g].members) for g in range(3)}
    assert [int(g) for g in groups] == sorted(means, key=means.get, reverse=True)
    assert len(classes(dom, "member")) == 12
    for badge in ("trained", "truncated", "zero_signal", "not trained"):
        assert f">{badge}</span>" in dom
    assert make_groups(8)[0].prompt.text in dom  # the full prompt
    assert "Answer 0 to prompts.jsonl:9 at update 8." in dom  # a completion
    assert "&lt;b&gt;not bold&lt;/b&gt; &amp; ünïcödé ✓" in dom  # text, never markup
    assert "<b>not bold</b>" not in dom


def test_viewer_opens_the_update_named_in_the_address(observe_dir, tmp_path):
    dom = browse(page(observe_dir) + "#update=4", tmp_path, "--dump-dom")
    assert "update 4 · completed · 3 groups" in dom
    assert 'class="selected " data-update="4"' in dom


# Played in the page after it loaded: keys and a filter, as a user would; then the outcome,
# and how often the feed was reloaded meanwhile, written into the DOM for --dump-dom.
DRIVE = """
let reloads = 0;
const viewerFeed = window.retrogradFeed;
window.retrogradFeed = (data) => {
  if (data.kind === "index") reloads += 1;
  viewerFeed(data);
};
setTimeout(() => {
  reloads = 0;
  const key = (k) => document.body.dispatchEvent(new KeyboardEvent("keydown", { key: k, bubbles: true }));
  key("j"); key("j"); key("ArrowDown"); key("k");
  const focused = document.querySelector(".group.focus").dataset.group;
  const filter = document.getElementById("filter");
  filter.value = "skipped";
  filter.dispatchEvent(new Event("change"));
  const skipped = [...document.querySelectorAll(".member")].map((m) => m.textContent);
  key("ArrowLeft");
  setTimeout(() => {
    const result = document.createElement("pre");
    result.id = "result";
    result.textContent = JSON.stringify({
      focused, skipped, title: document.getElementById("update-title").textContent,
      shown: document.querySelectorAll(".member").length, reloads,
    });
    document.body.append(result);
  }, 2500);
}, 1500);
"""


def test_viewer_keys_and_filters(observe_dir, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(observe_dir, site)
    html = (site / "index.html").read_text()
    tag = '<script src="viewer.js"></script>'
    assert tag in html
    (site / "drive.html").write_text(html.replace(tag, tag + '<script src="drive.js"></script>'))
    (site / "drive.js").write_text(DRIVE)
    dom = browse((site / "drive.html").as_uri(), tmp_path, "--dump-dom")
    found = re.search(r'<pre id="result">(.*?)</pre>', dom)
    assert found, dom[-3000:]
    result = json.loads(html_lib.unescape(found.group(1)))
    # Groups of update 8 by mean reward: 2, 0, 1. j j ↓ (held at the last) k: the second.
    assert result["focused"] == "0"
    # Only skipped members: group 0's four (zero signal) and the truncated one of each other.
    assert len(result["skipped"]) == 6
    assert sum("zero_signal" in m for m in result["skipped"]) == 4
    assert sum("truncated" in m for m in result["skipped"]) == 2
    # ← went to update 7, the filter still on.
    assert result["title"] == "update 7 · completed · 3 groups"
    assert result["shown"] == 6
    # While open, the page reloads feed/index.js by itself (every 3 s).
    assert result["reloads"] >= 1


def test_viewer_screenshot_is_a_picture(observe_dir, tmp_path):
    from PIL import Image

    shot = tmp_path / "viewer.png"
    browse(page(observe_dir), tmp_path, f"--screenshot={shot}")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1000)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, curves and badges, not a blank page
    background = max(colours)[0] / (image.width * image.height)
    assert background < 0.9
