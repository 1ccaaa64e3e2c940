"""The data of examples/agent/ (docs/agent.md), written deterministically.

    python examples/agent/make_warmstart.py             # warmstart.jsonl (SFT tool records)
    python examples/agent/make_warmstart.py --scenarios # also files.jsonl and files-eval.jsonl

Two small tasks over a workspace, with the built-in tools read_file and write_file:

- write: "Write the word WORD into the file FILE." -> one write_file call;
- copy: "The file SRC holds a word. Copy it into FILE." -> read_file SRC, then write_file.

Every scenario is graded by `grep -qx WORD FILE` (the file holds the word as a line).
The warm-start records are solved trajectories in the structured tool-record form
(formats.md §1.4) that SFT reads: the catalog, the conversation with the assistant's calls,
the tools' answers as the environment words them, and a closing "Done." that ends the
trajectory. Their words are disjoint from the scenarios' (WARM_WORDS), so the warm start
teaches the format and the tasks, not the answers.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

SYSTEM = "You work in a folder with tools. Call one tool per turn; say Done. when finished."

# The catalog of the run's toolset "files": the built-ins read_file@1 and write_file@1 as the
# model sees them (tests/unit/agent/test_example_agent.py checks they are the environment's).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a UTF-8 file from the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the workspace."}
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or overwrite a file in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]

# Scenario words (training and held-out) and warm-start words: disjoint lists.
WORDS = (
    "apple river stone cloud tiger lemon candle forest violin rocket garden mirror pencil "
    "silver thunder castle orange bridge window planet dragon winter coffee rabbit meadow "
    "harbor jacket ladder marble needle ocean pepper quartz saddle tunnel velvet walnut "
    "anchor basket cactus dolphin engine falcon glacier hammer island jungle kettle lantern "
    "magnet nectar oyster parrot puzzle rainbow shadow tomato"
).split()
WARM_WORDS = (
    "banana copper desert eagle feather ginger helmet igloo jelly kitten lizard mango "
    "nickel olive panda quilt robin salmon turtle umbrella valley wagon yogurt zebra "
    "acorn bubble cherry donkey"
).split()
FILES = ["answer.txt", "note.txt", "out.txt", "word.txt", "result.txt", "box.txt"]
SOURCES = ["secret.txt", "input.txt", "source.txt", "data.txt"]
HELD_OUT = 16  # the last words of WORDS are the held-out scenarios'


def write_task(word: str, dest: str) -> dict:
    return {
        "user": f"Write the word {word} into the file {dest}.",
        "files": {},
        "calls": [
            ("write_file", {"path": dest, "content": word}, f"wrote {len(word)} bytes to '{dest}'")
        ],
    }


def copy_task(word: str, src: str, dest: str) -> dict:
    return {
        "user": f"The file {src} holds a word. Copy it into {dest}.",
        "files": {src: word + "\n"},
        "calls": [
            ("read_file", {"path": src}, word + "\n"),
            ("write_file", {"path": dest, "content": word}, f"wrote {len(word)} bytes to '{dest}'"),
        ],
    }


def task(word: str, i: int, rng: random.Random) -> tuple[str, dict]:
    dest = rng.choice(FILES)
    if i % 2 == 0:
        return "write", write_task(word, dest)
    return "copy", copy_task(word, rng.choice(SOURCES), dest)


def scenario(sid: str, word: str, t: dict) -> dict:
    dest = t["calls"][-1][1]["path"]
    env: dict = {"verify": {"command": ["grep", "-qx", word, dest], "reward_on_success": 1.0}}
    if t["files"]:
        env = {"files": t["files"], **env}
    return {"id": sid, "system": SYSTEM, "user": t["user"], "metadata": {"env": env}}


def record(word: str, t: dict) -> dict:
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": t["user"]},
    ]
    for k, (name, arguments, answer) in enumerate(t["calls"]):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{k}", "name": name, "content": answer}
        )
    messages.append({"role": "assistant", "content": "Done."})
    return {"tools": TOOLS, "messages": messages, "metadata": {"word": word}}


def warmstart_records() -> list[dict]:
    rng = random.Random(7)
    return [record(w, task(w, i, rng)[1]) for i, w in enumerate(WARM_WORDS)]


def scenario_files() -> tuple[list[dict], list[dict]]:
    rng = random.Random(11)
    out = []
    for i, w in enumerate(WORDS):
        kind, t = task(w, i, rng)
        out.append(scenario(f"{kind}-{w}", w, t))
    return out[:-HELD_OUT], out[-HELD_OUT:]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{path.name}: {len(rows)} lines")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "warmstart.jsonl")
    p.add_argument("--scenarios", action="store_true", help="also rewrite the scenario files")
    args = p.parse_args(argv)
    write_jsonl(args.out, warmstart_records())
    if args.scenarios:
        train, held = scenario_files()
        write_jsonl(HERE / "files.jsonl", train)
        write_jsonl(HERE / "files-eval.jsonl", held)


if __name__ == "__main__":
    main()
