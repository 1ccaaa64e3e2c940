"""Reward program for examples/grpo.toml and ppo.toml (persistent protocol, retrograd-reward/1).

Reward 1.0 when the answer's first integer equals the sum or product asked in the prompt,
else 0.0. Reads one JSON object per line and answers in the same order.
"""

import json
import re
import sys


def score(prompt: str, completion: str) -> float:
    task = re.search(r"(\d+)\s*([+*])\s*(\d+)", prompt)
    answer = re.search(r"-?\d+", completion)
    if task is None or answer is None:
        return 0.0
    a, op, b = int(task[1]), task[2], int(task[3])
    return 1.0 if int(answer[0]) == (a + b if op == "+" else a * b) else 0.0


for line in sys.stdin:
    request = json.loads(line)
    if "protocol" in request or "_retrograd_batch_end" in request:
        reply = request  # the handshake and the end-of-batch marker are echoed
    else:
        reply = {"reward": score(request["prompt"], request["completion"])}
        for key in ("_retrograd_batch", "_retrograd_index"):
            reply[key] = request[key]
    print(json.dumps(reply, separators=(",", ":")), flush=True)
