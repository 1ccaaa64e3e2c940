"""The terminal display: plain lines when stdout is not a terminal, a live bar when it is."""

from __future__ import annotations

import re

from retrograd.observe import names
from retrograd.observe.progress import Progress, format_duration, step_stats

VALUES = {names.TRAIN_LOSS: 1.23456, names.LEARNING_RATE: 2e-5, names.TOKENS_PER_SECOND: 1234.4}


def lines(console) -> list[str]:
    return console.file.getvalue().splitlines()


def test_plain_lines_every_n_steps_plus_first_and_last(plain_console):
    progress = Progress(25, console=plain_console, every_steps=10, every_seconds=3600)
    for step in range(1, 26):
        progress.step(step, 1, VALUES)
    steps = [int(re.match(r"step (\d+)/25 ", line)[1]) for line in lines(plain_console)]
    assert steps == [1, 11, 21, 25]
    assert lines(plain_console)[0].startswith(
        "step 1/25 epoch 1 · loss 1.2346 · lr 2.00e-05 · 1,234 tok/s · elapsed 0:00:00 · eta "
    )
    assert "\x1b" not in plain_console.file.getvalue()  # no redrawing, no colours in a log


def test_plain_lines_every_few_seconds(plain_console, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("retrograd.observe.progress.monotonic", lambda: now[0])
    progress = Progress(100, console=plain_console, every_steps=1000, every_seconds=10)
    for step in range(1, 11):
        now[0] = 3.0 * step
        progress.step(step, 1, VALUES)
    steps = [int(re.match(r"step (\d+)/", line)[1]) for line in lines(plain_console)]
    assert steps == [1, 5, 9]  # at 3 s, then once 10 s have passed: 15 s, 27 s


def test_events_keep_brackets_and_summary_lists_rows(plain_console):
    progress = Progress(4, console=plain_console)
    progress.evaluation(2, {names.EVAL_LOSS: 0.5, names.EVAL_PERPLEXITY: 1.6487}, improved=True)
    progress.checkpoint("runs/[a]/step-2", 2)
    progress.summary({"checkpoints": "runs/[a]", "best eval/loss": 0.5, "tokens/s": 12345.6})
    progress.fail("[sft].data = x.jsonl: no such file")
    text = plain_console.file.getvalue()
    assert "eval at step 2: eval/loss 0.5, eval/perplexity 1.649 (best)" in text
    assert "checkpoint at step 2: runs/[a]/step-2" in text
    assert re.search(r"checkpoints\s+│ runs/\[a\]", text)
    assert re.search(r"tokens/s\s+│ 12,346", text)
    assert "run failed: [sft].data = x.jsonl: no such file" in text


HOSTILE = "ok\x1b[2J\x1b]0;owned\x07\x9b31m\rspoof\x00\x7f"  # clear, set the title, CSI, CR


def test_control_characters_in_events_and_failures_are_shown_not_sent(terminal_console):
    """A policy's answer or a program's stderr quoted in an event, a summary row or a failure
    reaches the terminal as escapes ("\\x1b"), never as a sequence the terminal obeys."""
    progress = Progress(4, console=terminal_console)
    progress.event(f"update 3, group 1: {HOSTILE}; the group is dropped")
    progress.summary({"last answer": HOSTILE})
    progress.fail(f"reward program: batch 2: stderr: {HOSTILE}")
    text = terminal_console.file.getvalue()
    for raw in ("\x1b[2J", "\x1b]0;", "\x07", "\x9b", "\rspoof", "\x00", "\x7f"):
        assert raw not in text, raw
    assert text.count("ok\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\rspoof\\x00\\x7f") == 3


def test_live_bar_on_a_terminal(terminal_console):
    progress = Progress(4, console=terminal_console, title="sft")
    for step in range(1, 5):
        progress.step(step, 1, VALUES)
        if step == 2:
            progress.checkpoint("ckpt/step-2", 2)
    progress.close()
    text = terminal_console.file.getvalue()
    assert "\r" in text or "\x1b[" in text  # redrawn in place, not appended as lines
    assert "4/4" in text and "loss 1.2346" in text and "eta " in text
    assert "checkpoint at step 2: ckpt/step-2" in text
    assert not any(line.startswith("step ") for line in text.splitlines())


def test_formatting_helpers():
    assert format_duration(3723.4) == "1:02:03"
    assert format_duration(float("nan")) == "-"
    assert step_stats({names.TRAIN_LOSS: float("nan")}) == "loss nan"
    assert step_stats({"reward/mean": 0.25}) == "reward 0.2500"
    assert step_stats({"distill/teacher_kl_mean": 4.1}) == "teacher KL 4.1000"
    assert step_stats({"policy/kl": 1.0}) == ""
