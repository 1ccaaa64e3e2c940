"""Reward program for plural nouns (persistent protocol retrograd-reward/1; oneshot works too).

The prompt asks "Plural of WORD:" for a regular English noun; the expected answer follows the
spelling rules (box -> boxes, city -> cities, cat -> cats). The answer is read as few-shot
evaluation harnesses read a base model's answer: up to its first line break. The reward
climbs a ladder, so that a group of answers from a small base model nearly always holds a
signal:

    1.0   the first line is the plural and nothing else ("cities", "Cities.", "cities\n..."):
          blank space and one final "." or "!" may follow it on that line
    0.75  the first line starts with the plural, then goes on ("cities and towns")
    0.25  the answer starts with the word itself, unchanged ("city ...")
    0.0   anything else, or a prompt without "Plural of WORD"

Why the first line: a small base model almost never ends its turn right after the plural
(Gemma 3 270M: about one answer in 10,000 ends there; its end-of-turn token has a probability
of about 1e-6), so a reward that asks for the end of the turn has nothing to reinforce; it
breaks the line after the plural about once in 70 answers, which a few updates find and
strengthen. What follows the line break is not scored.

Standard library only:

    reward_command = ["python3", "examples/rewards/plurals.py"]

Log to stderr, never to stdout: every stdout line is a reply.
"""

import json
import re
import sys

QUESTION = re.compile(r"plural of\s+([A-Za-z]+)", re.IGNORECASE)
FIRST_WORD = re.compile(r"\s*([A-Za-z]+)")
ALONE = re.compile(r"\s*[.!]?\s*")  # what may follow the plural on its line


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
        line = completion[first.end() :].split("\n", 1)[0]
        return 1.0 if ALONE.fullmatch(line) else 0.75
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
