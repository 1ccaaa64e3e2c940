"""Reward program for plural nouns (persistent protocol retrograd-reward/1; oneshot works too).

The prompt asks "Plural of WORD:" for a regular English noun; the expected answer follows the
spelling rules (box -> boxes, city -> cities, cat -> cats). The reward climbs a ladder, so that
a group of answers from a small base model nearly always holds a signal:

    1.0   the answer is the plural and nothing else ("cities")
    0.75  the answer starts with the plural, then goes on ("cities and towns")
    0.25  the answer starts with the word itself, unchanged ("city ...")
    0.0   anything else, or a prompt without "Plural of WORD"

Standard library only:

    reward_command = ["python3", "examples/rewards/plurals.py"]

Log to stderr, never to stdout: every stdout line is a reply.
"""

import json
import re
import sys

QUESTION = re.compile(r"plural of\s+([A-Za-z]+)", re.IGNORECASE)
FIRST_WORD = re.compile(r"\s*([A-Za-z]+)")


def plural(word: str) -> str:
    """The regular plural: -es after s, x, z, ch, sh; -ies after a consonant and y; else -s."""
    if re.search(r"(s|x|z|ch|sh)$", word):
        return word + "es"
    if re.search(r"[^aeiou]y$", word):
        return word[:-1] + "ies"
    return word + "s"


def score(prompt: str, completion: str) -> float:
    asked = QUESTION.search(prompt)
    first = FIRST_WORD.match(completion)
    if asked is None or first is None:
        return 0.0
    word, answer = asked[1].lower(), first[1].lower()
    if answer == plural(word):
        rest = completion[first.end() :].strip(" .!\n")
        return 1.0 if not rest else 0.75
    return 0.25 if answer == word else 0.0


def main() -> None:
    sys.stdin.reconfigure(encoding="utf-8")
    sys.stdout.reconfigure(encoding="utf-8")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if "protocol" in request or "_retrograd_batch_end" in request:
            reply = request  # the handshake and the end-of-batch marker are echoed as they came
        else:
            reply = {"reward": score(request["prompt"], request["completion"])}
            for key in ("_retrograd_batch", "_retrograd_index"):  # absent in oneshot mode
                if key in request:
                    reply[key] = request[key]
        print(json.dumps(reply, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
