"""reward_mode = "persistent" (formats.md §2.2, §2.4): handshake, batches, every failure."""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from reward_programs import assert_gone, pgids

from retrograd.errors import RetrogradError, RewardError
from retrograd.rewards import RewardProgram, RewardReply, RewardRequest, reward_program

REQUESTS = [RewardRequest("p", "a"), RewardRequest("p", "abc"), RewardRequest("p", "ab")]


def _fails(argv, match, requests=REQUESTS, **options):
    """Score once, expect a RewardError matching `match`; the program's group must be gone."""
    program = RewardProgram(argv, **options)
    with pytest.raises(RewardError, match=match) as caught:
        program.score(requests)
    assert program.pid is None
    assert_gone(argv)
    return str(caught.value)


def test_one_process_scores_batches_in_order(persistent):
    argv = persistent()
    with RewardProgram(argv) as program:
        assert program.pid is None  # started lazily
        assert program.score(REQUESTS) == [RewardReply(1.0), RewardReply(3.0), RewardReply(2.0)]
        pid = program.pid
        assert program.score([RewardRequest("p", "x" * 5)]) == [RewardReply(5.0)]
        assert program.pid == pid and program.batches == 2
        assert program.score([]) == []  # nothing sent, no batch number used
        assert program.batches == 2
    assert len(pgids(argv)) == 1
    assert_gone(argv)


def test_requests_carry_the_batch_and_index_fields(persistent, tmp_path):
    log = tmp_path / "seen.jsonl"
    argv = persistent(
        f"_log = open({str(log)!r}, 'a')\n"
        "_reply = reply\n"
        "def reply(req):\n"
        "    _log.write(json.dumps(req) + '\\n'); _log.flush()\n"
        "    return _reply(req)\n"
        "def marker(req):\n"
        "    _log.write(json.dumps(req) + '\\n'); _log.flush()\n"
        "    return [req]\n"
    )
    with RewardProgram(argv) as program:
        program.score([RewardRequest("Zähle ✓", "a\nb")])
        program.score(REQUESTS[:2])
    lines = log.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"prompt": "Zähle ✓", "completion": "a\nb", "_retrograd_batch": 0, "_retrograd_index": 0},
        {"_retrograd_batch_end": 0},
        {"prompt": "p", "completion": "a", "_retrograd_batch": 1, "_retrograd_index": 0},
        {"prompt": "p", "completion": "abc", "_retrograd_batch": 1, "_retrograd_index": 1},
        {"_retrograd_batch_end": 1},
    ]


def test_judge_weight_only_when_allowed(persistent):
    hooks = "_reply = reply\ndef reply(req):\n    return {**_reply(req), 'judge_weight': 0.25}\n"
    with RewardProgram(persistent(hooks), allow_judge_weight=True) as program:
        assert program.score(REQUESTS[:1]) == [RewardReply(1.0, 0.25)]
    message = _fails(persistent(hooks), "judge_weight.*only in GRPO with a \\[grpo.judge\\]")
    assert "batch 0, line 1" in message


@pytest.mark.parametrize(
    ("value", "match"),
    [("-1.0", "at least 0"), ("float('nan')", "not finite"), ("'heavy'", "must be a number")],
)
def test_bad_judge_weight(persistent, value, match):
    hooks = (
        f"_reply = reply\ndef reply(req):\n    return {{**_reply(req), 'judge_weight': {value}}}\n"
    )
    _fails(persistent(hooks), match, allow_judge_weight=True)


def test_unknown_reply_keys_and_blank_lines_are_tolerated(persistent):
    hooks = "_reply = reply\ndef reply(req):\n    return ['', {**_reply(req), 'note': 'x'}]\n"
    with RewardProgram(persistent(hooks)) as program:
        assert program.score(REQUESTS) == [RewardReply(1.0), RewardReply(3.0), RewardReply(2.0)]


def test_handshake_must_be_echoed(persistent):
    argv = persistent("def handshake(req):\n    return [{'protocol': 'other/2'}]\n")
    message = _fails(argv, "handshake reply must repeat")
    assert 'reward_mode = "oneshot"' in message
    assert "[grpo].reward_command = [" in message and "batch 0, line 1" in message


def test_handshake_with_spaces_is_the_same_object(persistent):
    argv = persistent('def handshake(req):\n    return [\'{"protocol": "retrograd-reward/1"}\']\n')
    with RewardProgram(argv) as program:
        assert program.score(REQUESTS[:1]) == [RewardReply(1.0)]


def test_a_oneshot_program_fails_the_handshake_by_timeout(oneshot):
    argv = oneshot()  # reads to EOF before answering: never answers the handshake
    start = time.monotonic()
    message = _fails(argv, "no reply within reward_timeout_seconds = 0.5", timeout=0.5)
    assert time.monotonic() - start < 3
    assert "during the handshake" in message and 'reward_mode = "oneshot"' in message


def test_first_deadline_covers_start_up(persistent):
    argv = persistent("time.sleep(1.0)\n")
    start = time.monotonic()
    _fails(argv, "during the handshake", timeout=0.4)
    assert time.monotonic() - start < 0.9


def test_batch_timeout_ends_the_worker(persistent):
    hooks = (
        "_reply = reply\n"
        "def reply(req):\n"
        "    if req['_retrograd_batch'] == 1:\n"
        "        time.sleep(30)\n"
        "    return _reply(req)\n"
    )
    argv = persistent(hooks)
    program = RewardProgram(argv, timeout=0.5)
    program.score(REQUESTS)
    start = time.monotonic()
    with pytest.raises(RewardError, match="batch 1: no reply within .* after 0 of 3 replies"):
        program.score(REQUESTS)
    assert 0.45 < time.monotonic() - start < 2
    assert_gone(argv)


@pytest.mark.parametrize(
    ("hooks", "match"),
    [
        (  # correlation: batch
            "_reply = reply\ndef reply(req):\n    return {**_reply(req), '_retrograd_batch': 7}\n",
            'line 1: "_retrograd_batch" does not match: expected 0',
        ),
        (  # correlation: index (answers out of order)
            "_reply = reply\ndef reply(req):\n"
            "    return {**_reply(req), '_retrograd_index': 2 - req['_retrograd_index']}\n",
            'line 1: "_retrograd_index" does not match: expected 0',
        ),
        (  # the fields not echoed at all
            "def reply(req):\n    return {'reward': 1.0}\n",
            'line 1: missing "_retrograd_batch"',
        ),
        (
            "_reply = reply\ndef reply(req):\n    return {**_reply(req), '_retrograd_index': True}\n",
            '"_retrograd_index" does not match',
        ),
        (  # wrong count: the marker comes early
            "_reply = reply\ndef reply(req):\n"
            "    return [] if req['_retrograd_index'] == 2 else _reply(req)\n",
            "line 3: end marker after 2 replies, expected 3",
        ),
        (  # extra line before the marker
            "_reply = reply\ndef reply(req):\n"
            "    out = _reply(req)\n"
            "    return [out, out] if req['_retrograd_index'] == 2 else out\n",
            "line 4: extra line: all 3 replies came",
        ),
        (  # extra line after the marker (in the same write: it is read with the marker)
            "def marker(req):\n    return [json.dumps(req) + '\\n' + json.dumps({'reward': 0.0})]\n",
            "extra line after the end marker",
        ),
        (  # the marker of another batch
            "def marker(req):\n    return [{'_retrograd_batch_end': 5}]\n",
            'line 4: the end marker must be {"_retrograd_batch_end": 0}',
        ),
        (
            "def marker(req):\n    return [{**req, 'x': 1}]\n",
            "the end marker must be",
        ),
        ("def marker(req):\n    sys.exit(0)\n", "the end marker is missing"),
        ("def reply(req):\n    return 'not json'\n", "line 1: malformed JSON"),
        (  # a reply nested past what any reader recurses through: named, with the limit
            "def reply(req):\n    return '{\"reward\": ' + '[' * 100000 + ']' * 100000 + '}'\n",
            r"line 1: malformed JSON \(nested more than 64 levels deep: line 1 column 75",
        ),
        ("def reply(req):\n    return '[1, 2]'\n", "expected a JSON object, got list"),
        (
            "_reply = reply\ndef reply(req):\n    return {**_reply(req), 'reward': float('inf')}\n",
            '"reward" is not finite',
        ),
        (
            "def reply(req):\n"
            '    return \'{"reward": NaN, "_retrograd_batch": 0, "_retrograd_index": 0}\'\n',
            '"reward" is not finite',
        ),
        (
            "def reply(req):\n"
            '    return \'{"reward": 1e400, "_retrograd_batch": 0, "_retrograd_index": 0}\'\n',
            '"reward" is not finite',
        ),
        (
            "_reply = reply\ndef reply(req):\n    return {**_reply(req), 'reward': '1.0'}\n",
            '"reward" must be a number',
        ),
        (
            "_reply = reply\ndef reply(req):\n    out = _reply(req); del out['reward']; return out\n",
            'missing "reward"',
        ),
    ],
)
def test_bad_replies(persistent, hooks, match):
    message = _fails(persistent(hooks), match)
    assert "[grpo].reward_command" in message and "batch 0" in message


def test_output_between_batches(persistent):
    # A line 50 ms after the end marker; then the program opens the FIFO `sent` to say so,
    # and the test waits for that (not for a time that a loaded machine may overrun).
    hooks = (
        "def marker(req):\n"
        "    send(req)\n"
        "    time.sleep(0.05)\n"
        "    send({'reward': 0.0})\n"
        "    with open(os.path.join(HERE, 'sent'), 'w') as f:\n"
        "        f.write('sent')\n"
        "    return []\n"
    )
    argv = persistent(hooks)
    sent = Path(argv[-1]).with_name("sent")
    os.mkfifo(sent)
    signal = os.open(sent, os.O_RDONLY | os.O_NONBLOCK)  # the program's open waits for this
    program = RewardProgram(argv)
    try:
        program.score(REQUESTS)
        assert select.select([signal], [], [], 60)[0], "the program never wrote its extra line"
    finally:
        os.close(signal)
    with pytest.raises(RewardError, match="batch 1: extra output after batch 0's end marker"):
        program.score(REQUESTS)
    assert_gone(argv)


def test_a_line_over_8_mib(persistent):
    hooks = (
        "def reply(req):\n    return '{\"reward\": 1.0, \"pad\": \"' + 'x' * (9 << 20) + '\"}'\n"
    )
    _fails(persistent(hooks), "line 1: a line over 8 MiB")


def test_the_program_exiting_early_is_quoted_with_its_stderr(persistent):
    hooks = (
        "def reply(req):\n"
        "    print('looking at', req['completion'], file=sys.stderr, flush=True)\n"
        "    raise RuntimeError('no idea how to score this')\n"
    )
    message = _fails(persistent(hooks), r"the program ended \(exit status 1\) after 0 of 3")
    assert "stderr (last 8 KiB):" in message
    assert "looking at a" in message and "RuntimeError: no idea how to score this" in message


def test_stderr_is_drained_and_only_its_tail_quoted(persistent):
    # 1 MiB of stderr before the first reply: a pipe nobody drained would block at 64 KiB.
    hooks = (
        "sys.stderr.write('early ' * 200000); sys.stderr.flush()\n"
        "def marker(req):\n"
        "    sys.stderr.write('x' * 20000 + 'THE END'); sys.stderr.flush()\n"
        "    sys.exit(3)\n"
    )
    message = _fails(persistent(hooks), r"exit status 3", timeout=5)
    tail = message.split("stderr (last 8 KiB):\n", 1)[1]
    assert tail.rstrip().endswith("THE END") and "early" not in tail
    assert 8000 < len(tail) < 8600


def test_a_program_that_cannot_start(tmp_path):
    with pytest.raises(RewardError, match="cannot start 'missing.py'.*No such file"):
        RewardProgram(["missing.py"]).score(REQUESTS)
    with pytest.raises(RewardError, match="cannot start './nope/reward.py'"):
        RewardProgram(["./nope/reward.py"], cwd=tmp_path).score(REQUESTS)


def test_relative_programs_resolve_against_the_working_directory(persistent, monkeypatch):
    argv = persistent(name="tools")
    script = argv[1]
    with open(script) as f:
        body = f.read()
    with open(script, "w") as f:
        f.write(f"#!{sys.executable}\n{body}")
    os.chmod(script, 0o755)
    folder = os.path.dirname(os.path.dirname(script))
    with RewardProgram(["tools/reward.py"], cwd=folder) as program:
        assert program.score(REQUESTS[:1]) == [RewardReply(1.0)]
    monkeypatch.chdir(folder)
    with RewardProgram(["tools/reward.py"]) as program:
        assert program.score(REQUESTS[:1]) == [RewardReply(1.0)]


def test_after_a_failed_batch_a_fresh_worker_starts(persistent):
    hooks = (
        "_reply = reply\n"
        "def reply(req):\n"
        "    if req['completion'] == 'boom':\n"
        "        return 'oops'\n"
        "    return _reply(req)\n"
    )
    argv = persistent(hooks)
    with RewardProgram(argv) as program:
        with pytest.raises(RewardError, match="batch 0, line 1: malformed JSON"):
            program.score([RewardRequest("p", "boom")])
        assert program.score(REQUESTS) == [RewardReply(1.0), RewardReply(3.0), RewardReply(2.0)]
        assert program.batches == 2
    first, second = pgids(argv)
    assert first != second
    assert_gone(argv)


def test_reward_program_from_a_config_section(persistent):
    argv = persistent(
        "_reply = reply\ndef reply(req):\n    return {**_reply(req), 'judge_weight': 1}\n"
    )
    section = SimpleNamespace(
        reward_command=argv, reward_mode="persistent", reward_timeout_seconds=5.0, judge=None
    )
    program = reward_program(section, "[ppo]")
    assert program.timeout == 5.0 and program.mode == "persistent"
    with pytest.raises(RewardError, match=r"^\[ppo\].reward_command = .*only in GRPO"):
        program.score(REQUESTS)
    section.judge = object()
    with reward_program(section) as program:
        assert program.score(REQUESTS[:1]) == [RewardReply(1.0, 1.0)]
    assert issubclass(RewardError, RetrogradError)


def test_invalid_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="persistent or oneshot"):
        RewardProgram(["x"], mode="sometimes")
    with pytest.raises(ValueError, match="above 0"):
        RewardProgram(["x"], timeout=0)
    with pytest.raises(ValueError, match="argument list"):
        RewardProgram([])


def test_a_large_batch_costs_milliseconds(persistent):
    requests = [RewardRequest(f"Calculate {i} + 1.", "x" * (i % 50)) for i in range(256)]
    with RewardProgram(persistent()) as program:
        program.score(requests[:1])  # start-up and handshake
        start = time.perf_counter()
        for _ in range(5):
            replies = program.score(requests)
        per_batch = (time.perf_counter() - start) / 5
    assert [r.reward for r in replies] == [float(i % 50) for i in range(256)]
    assert per_batch < 0.5, per_batch
