"""[observe]: the records observe.jsonl holds, the feed the viewer reads, and how the writer
behaves when the directory is taken, the disk lags or fails, or the run resumes (formats.md §6)."""

from __future__ import annotations

import errno
import json
import threading
import time
from pathlib import Path

import pytest

from retrograd.config.tracking import ObserveSection
from retrograd.observe import feed, rollouts
from retrograd.observe.rollouts import ObserveWriter, clip_text
from tests.factories.rollouts import finish_update, make_groups, make_prompt, write_run
from tests.unit.observe.conftest import captured_console


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "observe.jsonl").read_text().splitlines()]


def of_type(directory: Path, kind: str) -> list[dict]:
    return [r for r in records(directory) if r["type"] == kind]


def index(directory: Path) -> dict:
    return feed.unscript((directory / "feed" / "index.js").read_text())


def update_view(directory: Path, update: int) -> dict:
    return feed.unscript((directory / "feed" / feed.update_file(update)).read_text())


def open_writer(directory: Path, console=None, resumed_from_update=None, **section):
    return ObserveWriter.open(
        ObserveSection(directory=directory, **section),
        algorithm="grpo",
        model="m.gguf",
        params={},
        resumed_from_update=resumed_from_update,
        console=console or captured_console(terminal=False),
    )


def output(console) -> str:
    return console.file.getvalue()


def test_records_carry_the_spec_fields(tmp_path):
    console = captured_console(terminal=False)
    write_run(tmp_path, range(1, 3), console=console)
    assert output(console) == ""  # no warning on the normal path
    log = records(tmp_path)
    assert [r["type"] for r in log[:2]] == ["run", "prompt"]
    for r in log:
        assert r["v"] == 1 and r["segment"] == 0
        assert isinstance(r["time"], float) and isinstance(r["batch"], int)
    run = log[0]
    assert run["algorithm"] == "grpo" and run["resumed_from_update"] is None
    assert run["params"]["prompts"] == "prompts.jsonl"  # a Path, written as its text
    # One batch per call: run, rollouts of update 1 (prompts first), outcome, update, ...
    assert [r["batch"] for r in log] == sorted(r["batch"] for r in log)
    assert len({r["batch"] for r in log}) == 1 + 3 * 2

    rows = [r for r in of_type(tmp_path, "rollout") if r["update"] == 1]
    assert len(rows) == 3 * 4
    groups = make_groups(1)
    for r in rows:
        source = groups[r["group"]].members[r["member"]]
        assert r["prompt"] == groups[r["group"]].prompt.key
        assert r["completion"] == source.text
        assert r["tokens"] == source.n_tokens and r["truncated"] == source.truncated
        assert r["reward"] == pytest.approx(source.reward)
        assert r["reward_raw"] == source.reward_raw and r["judge_term"] == source.judge_term
        assert r["advantage"] == pytest.approx(source.advantage)
        assert r["skip_reason"] == source.skip_reason
        # Before training: excluded members are false, the others not known yet.
        assert r["trained"] is (False if source.skip_reason else None)
    assert {r["skip_reason"] for r in rows} == {None, "truncated", "zero_signal"}

    outcome = of_type(tmp_path, "outcome")[0]
    finish_update(groups)
    expected = {(r.group, r.member): r.trained for g in groups for r in g.members}
    assert {(e["group"], e["member"]): e["trained"] for e in outcome["entries"]} == expected

    updates = of_type(tmp_path, "update")
    assert [(u["update"], u["status"]) for u in updates] == [(1, "completed"), (2, "completed")]
    assert updates[1]["metrics"]["policy/kl"] == pytest.approx(0.02)
    for name in rollouts.VIEWER_FILES:
        assert (tmp_path / name).read_bytes()


def test_feed_summarises_every_update_and_holds_the_texts(tmp_path):
    write_run(tmp_path, range(1, 4))
    data = index(tmp_path)
    assert data["run"]["algorithm"] == "grpo"
    rows = data["updates"]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert rows[2]["kl"] == pytest.approx(0.03) and rows[0]["status"] == "completed"
    assert all(r["texts"] and r["groups"] == 3 and r["members"] == 12 for r in rows)
    view = update_view(tmp_path, 2)
    assert len(view["groups"]) == 3
    member = view["groups"][1]["members"][0]
    assert member["completion"].startswith("Answer 0 to prompts.jsonl:4 at update 2")
    assert member["trained"] is True  # the outcome folded in
    assert view["prompts"]["prompts.jsonl:4"][1]["content"] == make_prompt(3).text


def test_every_records_texts_on_multiples_only(tmp_path):
    write_run(tmp_path, range(1, 6), every=2)
    texts = {r["update"]: r["completion"] is not None for r in of_type(tmp_path, "rollout")}
    assert texts == {1: False, 2: True, 3: False, 4: True, 5: False}
    assert [u["update"] for u in of_type(tmp_path, "update")] == [1, 2, 3, 4, 5]
    # The prompts a text update shows, and no other: update 1's first group is not among them.
    keys = {p["key"] for p in of_type(tmp_path, "prompt")}
    assert keys == {g.prompt.key for u in (2, 4) for g in make_groups(u)}
    assert [r["texts"] for r in index(tmp_path)["updates"]] == [False, True, False, True, False]


def test_clip_text_counts_unicode_characters():
    assert clip_text("short", 0) == "short"
    assert clip_text("short", 5) == "short"
    assert clip_text("héllo wörld", 5) == "héllo… [6 more characters]"
    assert clip_text("🙂" * 10, 3) == "🙂🙂🙂… [7 more characters]"


def test_max_text_chars_cuts_completions_and_prompts(tmp_path):
    write_run(tmp_path, range(1, 2), max_text_chars=10)
    for r in of_type(tmp_path, "rollout"):
        source = make_groups(1)[r["group"]].members[r["member"]].text
        assert r["completion"] == f"{source[:10]}… [{len(source) - 10} more characters]"
    for p in of_type(tmp_path, "prompt"):
        content = p["messages"][1]["content"]
        assert len(content.split("…")[0]) == 10 and content.endswith("more characters]")


def test_each_prompt_is_recorded_once(tmp_path):
    with open_writer(tmp_path) as writer:
        for _ in range(3):
            writer.prompt(make_prompt(0))
        for u in (1, 2, 3):  # groups of neighbouring updates share prompts
            writer.rollouts(u, make_groups(u))
    expected = {make_prompt(0).key} | {g.prompt.key for u in (1, 2, 3) for g in make_groups(u)}
    keys = [p["key"] for p in of_type(tmp_path, "prompt")]
    assert len(keys) == len(set(keys)) and set(keys) == expected
    # A resumed run knows what the log already holds.
    with open_writer(tmp_path, resumed_from_update=3) as writer:
        writer.rollouts(4, make_groups(4))
    expected |= {g.prompt.key for g in make_groups(4)}
    keys = [p["key"] for p in of_type(tmp_path, "prompt")]
    assert len(keys) == len(set(keys)) and set(keys) == expected


def test_absent_or_disabled_section_opens_nothing(tmp_path):
    assert (
        ObserveWriter.open(None, algorithm="grpo", model="m", params={}, resumed_from_update=None)
        is None
    )
    assert open_writer(tmp_path / "off", enabled=False) is None
    assert not (tmp_path / "off").exists()


def test_a_directory_held_by_another_writer_is_not_written(tmp_path):
    console = captured_console(terminal=False)
    first = open_writer(tmp_path)
    assert open_writer(tmp_path, console=console) is None
    assert output(console).count("warning: [observe]") == 1
    assert "locked by another writer" in output(console) and "training continues" in output(console)
    first.rollouts(1, make_groups(1))
    first.close()
    assert {r["segment"] for r in records(tmp_path)} == {0}
    # Released by close (and by the process's death: a lock file alone holds nothing).
    again = open_writer(tmp_path)
    assert again is not None
    again.close()


def test_resume_continues_the_log_and_replaces_replayed_updates(tmp_path):
    write_run(tmp_path, range(1, 5))
    # Resumed from the checkpoint of update 2: updates 3 and 4 run again; this time 3 only.
    write_run(tmp_path, range(3, 4), resumed_from_update=2)
    log = records(tmp_path)
    runs = [r for r in log if r["type"] == "run"]
    assert [(r["segment"], r["resumed_from_update"]) for r in runs] == [(0, None), (1, 2)]
    assert {r["segment"] for r in log[log.index(runs[1]) :]} == {1}
    assert len([u for u in log if u["type"] == "update"]) == 5  # the log keeps everything
    data = index(tmp_path)
    assert [(r["update"], r["segment"]) for r in data["updates"]] == [(1, 0), (2, 0), (3, 1)]
    assert [s["resumed_from_update"] for s in data["run"]["segments"]] == [None, 2]
    assert update_view(tmp_path, 3)["segment"] == 1
    assert not (tmp_path / "feed" / feed.update_file(4)).exists()


def test_reopening_rebuilds_the_feed_and_drops_an_unfinished_line(tmp_path):
    write_run(tmp_path, range(1, 3))
    for path in (tmp_path / "feed").iterdir():
        path.unlink()
    with open(tmp_path / "observe.jsonl", "a") as f:
        f.write('{"v": 1, "type": "rollout", "upd')  # a writer killed mid-line
    write_run(tmp_path, range(3, 4), resumed_from_update=2)
    assert all(isinstance(r, dict) for r in records(tmp_path))  # every line parses
    assert [r["update"] for r in index(tmp_path)["updates"]] == [1, 2, 3]
    assert update_view(tmp_path, 1)["groups"][0]["members"][0]["completion"]


def test_a_full_queue_drops_batches_and_counts_them(tmp_path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    write = ObserveWriter._write

    def slow_disk(self, feed_, log, batch):
        if batch[0]["type"] == "run":
            entered.set()
            assert release.wait(10)
        write(self, feed_, log, batch)

    monkeypatch.setattr(rollouts, "QUEUE_BATCHES", 2)
    monkeypatch.setattr(ObserveWriter, "_write", slow_disk)
    writer = open_writer(tmp_path)
    assert entered.wait(10)  # the thread is stuck on the run record; the queue is empty
    writer.rollouts(1, make_groups(1))  # queued, with its prompts
    writer.update(1, "completed", {})  # queued
    writer.rollouts(2, make_groups(2))  # dropped, and its new prompt with it
    writer.update(2, "completed", {})  # dropped
    assert writer.dropped_batches == 2
    release.set()
    while not writer._queue.empty():  # the disk catches up
        time.sleep(0.01)
    writer.rollouts(3, make_groups(3))
    writer.close()
    assert writer.dropped_batches == 2
    log = records(tmp_path)
    assert [u["update"] for u in log if u["type"] == "update"] == [1]
    assert {r["update"] for r in log if r["type"] == "rollout"} == {1, 3}
    assert sorted({r["batch"] for r in log}) == [1, 2, 3, 6]  # the gap shows the drops
    # The prompt dropped with update 2 came back with update 3.
    keys = [p["key"] for p in log if p["type"] == "prompt"]
    assert len(keys) == len(set(keys))
    assert {g.prompt.key for u in (1, 2, 3) for g in make_groups(u)} == set(keys)


def test_a_disk_error_turns_the_export_off_with_one_warning(tmp_path, monkeypatch):
    def full_disk(self, feed_, log, batch):
        if batch[0]["type"] == "update":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, feed_, log, batch)

    write = ObserveWriter._write
    monkeypatch.setattr(ObserveWriter, "_write", full_disk)
    console = captured_console(terminal=False)
    writer = open_writer(tmp_path, console=console)
    for u in (1, 2, 3):  # the loop goes on calling; nothing raises
        groups = make_groups(u)
        writer.rollouts(u, groups)
        writer.outcome(u, groups)
        writer.update(u, "completed", {"reward/mean": 0.5})
    writer.close()
    assert writer.disabled
    text = output(console)
    assert text.count("warning: [observe]") == 1
    assert "No space left on device" in text and "training continues" in text
    assert not of_type(tmp_path, "update")
    # Nothing is written after the error (the first update record).
    assert {r["update"] for r in of_type(tmp_path, "rollout")} == {1}


def test_non_finite_values_are_left_out(tmp_path):
    groups = make_groups(1)
    groups[1].members[1].advantage = float("nan")
    with open_writer(tmp_path) as writer:
        writer.rollouts(1, groups)
        writer.update(1, "skipped", {"policy/kl": float("inf"), "reward/mean": 0.25})
    rollout = next(r for r in of_type(tmp_path, "rollout") if (r["group"], r["member"]) == (1, 1))
    assert rollout["advantage"] is None
    assert of_type(tmp_path, "update")[0]["metrics"] == {"reward/mean": 0.25}
    assert index(tmp_path)["updates"][0]["status"] == "skipped"


def test_viewer_files_ship_with_the_package():
    from importlib import resources

    viewer = resources.files("retrograd.observe") / "viewer"
    for name in rollouts.VIEWER_FILES:
        assert (viewer / name).read_text(encoding="utf-8").strip()


@pytest.mark.parametrize(
    "data",
    [b"", b"a\n", b"a\nb\n", b"a\nbro", b"ken", b"a\n" + b"x" * 70000, b"b" * 70000 + b"\nc\n"],
)
def test_an_unfinished_last_line_is_cut(tmp_path, data):
    path = tmp_path / "log"
    path.write_bytes(data)
    rollouts.cut_unfinished_line(path, chunk=1000)
    kept = data[: data.rfind(b"\n") + 1]
    assert path.read_bytes() == kept


def test_a_lone_surrogate_is_written_escaped_and_the_export_goes_on(tmp_path):
    """A completion or prompt holding a lone surrogate (a JSON \\ud800 escape in the data) is
    written with ASCII escapes and reads back as it was; the export stays on."""

    def hostile(update: int):
        groups = make_groups(update)
        groups[0].members[0].text = "bad \ud800 text"
        return groups

    console = captured_console(terminal=False)
    write_run(tmp_path, range(1, 3), console=console, groups_of=hostile)
    assert output(console) == ""  # no "export disabled" warning
    (tmp_path / "observe.jsonl").read_bytes().decode("utf-8")  # a UTF-8 file
    texts = [
        r["completion"] for r in of_type(tmp_path, "rollout") if r["group"] == r["member"] == 0
    ]
    assert texts == ["bad \ud800 text"] * 2
    assert [u["update"] for u in of_type(tmp_path, "update")] == [1, 2]
    member = update_view(tmp_path, 2)["groups"][0]["members"][0]
    assert member["completion"] == "bad \ud800 text"
