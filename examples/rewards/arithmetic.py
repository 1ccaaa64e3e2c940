"""Reward program for arithmetic prompts (persistent protocol retrograd-reward/1; oneshot works too).

The prompt holds an expression such as "Calculate 14 + 7." or "What is 3 + 4 × 5?": integers or
decimals, + - * / × ÷, up to two operators, usual precedence. The reward is
1 / (1 + |answer - expected|), where answer is the first integer in the completion, and 0.0
when the completion holds no integer (or the prompt no expression). Standard library only:

    reward_command = ["python3", "examples/rewards/arithmetic.py"]
"""

import json
import re
import sys

NUMBER = r"(-?\d+(?:\.\d+)?)"
OPERATOR = r"\s*([-+*/×÷])\s*"
EXPRESSION = re.compile(NUMBER + OPERATOR + NUMBER + f"(?:{OPERATOR}{NUMBER})?")
INTEGER = re.compile(r"-?\d+")
APPLY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "×": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "÷": lambda a, b: a / b,
}


def expected(prompt: str) -> float | None:
    """The value of the first expression in the prompt; None when there is none (or it divides
    by zero)."""
    match = EXPRESSION.search(prompt)
    if match is None:
        return None
    a, op1, b, op2, c = match.groups()
    a, b = float(a), float(b)
    try:
        if op2 is None:
            return APPLY[op1](a, b)
        if op2 in "*/×÷" and op1 in "+-":  # the second operator binds first
            return APPLY[op1](a, APPLY[op2](b, float(c)))
        return APPLY[op2](APPLY[op1](a, b), float(c))
    except ZeroDivisionError:
        return None


def score(prompt: str, completion: str) -> float:
    target = expected(prompt)
    answer = INTEGER.search(completion)
    if target is None or answer is None:
        return 0.0
    return 1.0 / (1.0 + abs(int(answer[0]) - target))


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
