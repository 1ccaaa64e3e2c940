"""reward_mode = "oneshot" (formats.md §2.3): one process per batch, stdin closed, exit 0."""

from __future__ import annotations

import json
import sys
import time

import pytest
from reward_programs import assert_gone, pgids

from retrograd.errors import RewardError
from retrograd.rewards import RewardProgram, RewardReply, RewardRequest

REQUESTS = [RewardRequest("p", "a"), RewardRequest("p", "abc"), RewardRequest("p", "ab")]


def _oneshot(argv, **options):
    return RewardProgram(argv, mode="oneshot", where="[ppo].reward_command", **options)


def _fails(argv, match, **options):
    with pytest.raises(RewardError, match=match) as caught:
        _oneshot(argv, **options).score(REQUESTS)
    assert_gone(argv)
    return str(caught.value)


def test_one_process_per_batch_plain_requests(oneshot):
    # The program refuses anything but plain requests: no handshake, no reserved fields.
    hooks = (
        "_reply = reply\n"
        "def reply(req):\n"
        "    assert set(req) == {'prompt', 'completion'}, req\n"
        "    return _reply(req)\n"
    )
    argv = oneshot(hooks)
    program = _oneshot(argv)
    assert program.score(REQUESTS) == [RewardReply(1.0), RewardReply(3.0), RewardReply(2.0)]
    assert program.score(REQUESTS[:1]) == [RewardReply(1.0)]
    assert program.pid is None
    assert len(set(pgids(argv))) == 2
    assert_gone(argv)
    program.close()  # nothing to close


def test_a_program_without_a_last_newline(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(
        "import json, sys\n"
        "out = [json.dumps({'reward': len(json.loads(l)['completion'])}) for l in sys.stdin]\n"
        "sys.stdout.write('\\n'.join(out))\n"
    )
    assert _oneshot([sys.executable, str(script)]).score(REQUESTS) == [
        RewardReply(1.0),
        RewardReply(3.0),
        RewardReply(2.0),
    ]


def test_a_large_batch_does_not_deadlock(oneshot):
    # 4 MiB of requests while the program answers as it reads: both pipes fill unless the
    # writer and the reader run together.
    hooks = (
        "for line in sys.stdin:\n"
        "    send({**reply(json.loads(line)), 'pad': 'x' * 100})\n"
        "sys.exit(0)\n"
    )
    requests = [RewardRequest("p" * 1000, "c" * (i % 7)) for i in range(4000)]
    replies = _oneshot(oneshot(hooks), timeout=20).score(requests)
    assert [r.reward for r in replies] == [float(i % 7) for i in range(4000)]


def test_non_zero_exit_fails_with_stderr(oneshot):
    hooks = "print('cannot load the grader', file=sys.stderr)\nsys.exit(2)\n"
    message = _fails(oneshot(hooks), r"batch 0: the program ended with exit status 2")
    assert message.startswith("[ppo].reward_command = [")
    assert "cannot load the grader" in message


def test_killed_by_a_signal(oneshot):
    _fails(oneshot("import signal\nos.kill(os.getpid(), signal.SIGTERM)\n"), "signal SIGTERM")


@pytest.mark.parametrize(
    ("hooks", "match"),
    [
        ("_reply = reply\ndef reply(req):\n    return [_reply(req)] * 2\n", "6 reply lines for 3"),
        ("def reply(req):\n    return []\n", "0 reply lines for 3 requests"),
        ("def reply(req):\n    return '{\"reward\": 1'\n", "line 1: malformed JSON"),
        (
            "def reply(req):\n    return '{\"reward\": ' + '[' * 900 + ']' * 900 + '}'\n",
            r"line 1: malformed JSON \(nested more than 64 levels deep",
        ),
        (
            "def reply(req):\n    return {'reward': 1.0, 'judge_weight': 2.0}\n",
            'line 1: "judge_weight" is allowed only',
        ),
        ("def reply(req):\n    return '{\"reward\": -Infinity}'\n", '"reward" is not finite'),
        ("def reply(req):\n    return '{\"reward\": true}'\n", '"reward" must be a number'),
    ],
)
def test_bad_output(oneshot, hooks, match):
    message = _fails(oneshot(hooks), match)
    if "line 1" in match:
        assert "\n  the line: {" in message


def test_output_is_capped_at_8_mib(oneshot):
    hooks = "def reply(req):\n    return 'x' * (3 << 20)\n"
    _fails(oneshot(hooks), "more than 8 MiB of output")


def test_timeout(oneshot):
    start = time.monotonic()
    _fails(
        oneshot("time.sleep(30)\n"), "not finished within reward_timeout_seconds = 0.5", timeout=0.5
    )
    assert time.monotonic() - start < 2


def test_a_leftover_child_does_not_hold_the_batch(oneshot):
    # The program answers and exits, leaving a child that holds stdout open: the batch ends
    # with the program, and the child dies with the group.
    argv = oneshot("spawn_sleeper()\n")
    start = time.monotonic()
    assert _oneshot(argv, timeout=10).score(REQUESTS)[0] == RewardReply(1.0)
    assert time.monotonic() - start < 3
    assert_gone(argv)


def test_judge_weight_when_allowed(oneshot):
    hooks = "def reply(req):\n    return json.dumps({'reward': 0.5, 'judge_weight': 0})\n"
    replies = _oneshot(oneshot(hooks), allow_judge_weight=True).score(REQUESTS[:1])
    assert replies == [RewardReply(0.5, 0.0)]
    assert json.loads(REQUESTS[0].line()) == {"prompt": "p", "completion": "a"}


def test_nul_and_lone_surrogates_in_requests_and_replies(oneshot):
    """A request whose text is not text (NUL, a lone surrogate) still goes out; a reply with a
    \\ud800 escape in a key it ignores is read; a raw NUL inside a reply's string is malformed
    JSON naming its line, a RewardError, never a UnicodeError."""
    hooks = r"""
def reply(req):
    return '{"reward": %d, "note": "\\ud800"}' % len(req["completion"])
"""
    request = RewardRequest("p\ud800", "c\x00\ud800")
    assert _oneshot(oneshot(hooks)).score([request]) == [RewardReply(3.0)]
    nul = 'def reply(req):\n    return \'{"reward": 1, "note": "a\\x00b"}\'\n'
    with pytest.raises(RewardError, match="line 1: malformed JSON"):
        _oneshot(oneshot(nul)).score([request])
