"""Reward program for short answers (persistent protocol retrograd-reward/1; oneshot works too).

Reward 1.0 for an answer of at most --words words, falling linearly to 0.0 at three times that;
with --require WORD, 0.0 for an answer that does not contain WORD (case-insensitive). Standard
library only; its settings are arguments, so one program serves several runs:

    reward_command = ["python3", "examples/rewards/length.py", "--words", "12", "--require", "arr"]

Log to stderr, never to stdout: every stdout line is a reply.
"""

import argparse
import json
import sys


def score(completion: str, words: int, require: str | None) -> float:
    if require is not None and require.lower() not in completion.lower():
        return 0.0
    count = len(completion.split())
    return max(0.0, min(1.0, (3 * words - count) / (2 * words)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=20, help="longest answer with full reward")
    parser.add_argument("--require", help="a word every rewarded answer must contain")
    args = parser.parse_args()
    sys.stdin.reconfigure(encoding="utf-8")
    sys.stdout.reconfigure(encoding="utf-8")
    scored = 0
    for line in sys.stdin:
        request = json.loads(line)
        if "protocol" in request or "_retrograd_batch_end" in request:
            reply = request  # echoed unchanged
        else:
            reward = score(request["completion"], args.words, args.require)
            reply = {"reward": reward, **{k: v for k, v in request.items() if k.startswith("_")}}
            scored += 1
        print(json.dumps(reply, separators=(",", ":")), flush=True)
    print(f"length.py: scored {scored} answers", file=sys.stderr)  # stdin closed: end of run


if __name__ == "__main__":
    main()
