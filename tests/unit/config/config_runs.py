"""Minimal valid run documents per algorithm, for the config tests to break one key at a time."""

from __future__ import annotations

import copy
from typing import Any

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, "seed": 1}
REWARD = {"prompts": "p.jsonl", "reward_command": ["python3", "reward.py"]}

SECTIONS: dict[str, dict[str, Any]] = {
    "sft": {"sft": {"data": "d.jsonl"}},
    "ppo": {
        "ppo": {
            **REWARD,
            "updates": 2,
            "rollout_batch_size": 4,
            "ppo_epochs": 1,
            "clip_range": 0.2,
            "kl_coefficient": 0.0,
            "sampling": {**SAMPLING, "temperature": 0.7},
        }
    },
    "grpo": {
        "grpo": {
            **REWARD,
            "updates": 2,
            "prompts_per_update": 2,
            "group_size": 4,
            "grpo_epochs": 1,
            "clip_range_low": 0.2,
            "clip_range_high": 0.28,
            "kl_coefficient": 0.0,
            "sampling": dict(SAMPLING),
        }
    },
    "distill": {
        "distill": {
            "teacher_path": "t.gguf",
            "prompts": "p.jsonl",
            "updates": 1,
            "prompts_per_update": 1,
            "sampling": dict(SAMPLING),
        }
    },
    "preference": {"preference": {"data": "pairs.jsonl"}},
    "agent_grpo": {
        "agent": {
            "scenarios": "s.jsonl",
            "judge": {"type": "command", "command": ["python3", "judge.py"]},
        }
    },
}


def run_doc(algorithm: str = "sft", **sections: dict[str, Any] | None) -> dict[str, Any]:
    """A valid document for `algorithm`; each keyword merges into a section, and None removes
    a section or a key: `run_doc("grpo", grpo={"group_size": 1, "judge_weight": None})`."""
    doc: dict[str, Any] = {
        "run": {"algorithm": algorithm},
        "model": {"path": "model.gguf"},
        "output": {"path": "out.gguf"},
        "lora": {},
        **copy.deepcopy(SECTIONS[algorithm]),
    }
    for name, patch in sections.items():
        if patch is None:
            doc.pop(name, None)
        else:
            _merge(doc.setdefault(name, {}), patch)
    return doc


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = value
