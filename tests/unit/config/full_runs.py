"""Run documents that set keys away from their defaults, for the round-trip tests of
RunConfig.to_toml: together they set every key of every table of a run file (the test checks
that), with strings TOML must escape and keys it must quote.

Each is a plain document (as tomllib reads a file) for a directory that holds nothing: the
loader reads no data file, so the paths need not exist.
"""

from __future__ import annotations

import copy
from typing import Any

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24, "seed": 5}
TRICKY = 'quote " backslash \\ tab \t newline \n del \x7f é 日本 😀'

HEAD: dict[str, Any] = {
    "model": {"path": "models/base.gguf", "device": "cpu"},
    "output": {"path": "out/result.gguf", "kind": "adapter"},
    "lora": {
        "rank": 4,
        "alpha": 8.5,
        "seed": 7,
        "targets": ["q", "blk.*.attn_v.weight", "ffn_down"],
        "dtype": "f32",
    },
    "metrics": {"tensorboard_dir": "tb", "wandb_export_dir": "wandb"},
}

# every key of [training] away from its default, in a run that may set each of them
TRAINING_SFT = {
    "trainable": "lora",
    "optimizer": "sgd",
    "lr": 0.002,
    "lr_scheduler": "cosine",
    "warmup_steps": 3,
    "weight_decay": 0.1,
    "max_grad_norm": 0.5,
    "epochs": 2,
    "ctx": 256,
    "micro_batch": 64,
    "gradient_accumulation": 2,
    "threads": 2,
    "gradient_checkpointing": True,
    "checkpoint_every_n_layers": 2,
    "checkpoint_dtype": "bf16",
    "chunked_ce_tiles": 4,
    "chunked_ce_seq_chunk": 0,
    "require_gpu_resident": True,
    "parallel": "ddp",
    "dist_timeout_seconds": 60,
    "max_gpu_duty_cycle": 0.5,
    "kv_dtype": "f32",
}
TRAINING_ROLLOUT = {
    "ctx": 256,
    "micro_batch": 64,
    "generation_concurrency": 3,
    "generation_batch": 5,
    "shared_prefix_fanout": 4,
    "fast_sampling_context": False,
}

SFT = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "sft", "verbose": False},
    "training": TRAINING_SFT,
    "evaluation": {"data": "held.jsonl", "every_iterations": 2, "patience": 3, "min_delta": 0.01},
    "checkpoint": {
        "directory": "ckpt",
        "mode": "steps_and_best_eval",
        "every_steps": 5,
        "resume_from": "ckpt/step-5.state",
    },
    "sft": {
        "data": "train.jsonl",
        "data_format": "jsonl",
        "shuffle": False,
        "template_variables": {
            "enable_thinking": False,
            "persona": TRICKY,
            "a key with spaces": [1, 2.5, "x"],
            "nested": {"depth": 2, "list": [{"inline": True}]},
        },
    },
}

PARTIAL = {
    "run": {"algorithm": "sft"},
    "model": {"path": "base.gguf"},
    "output": {"path": "out/model.gguf", "kind": "model"},
    "training": {"trainable": "partial", "optimizer": "gefen"},
    "optimizer": {
        "gefen": {
            "variant": "quantized_m",
            "block_size": 256,
            "min_numel": 100,
            "beta1": 0.8,
            "beta2": 0.99,
            "eps": 1e-6,
        }
    },
    "trainable": {
        "layers": "last:2",
        "modules": ["attn", "blk.*.ffn_up.weight"],
        "norms": True,
        "biases": True,
        "output_head": True,
    },
    "sft": {"data": "corpus.txt", "data_format": "text"},
}

REWARD = {
    "prompts": "prompts.jsonl",
    "reward_command": ["python3", "reward.py", "--flag=value with space"],
    "reward_mode": "oneshot",
    "reward_timeout_seconds": 12.5,
}

PPO = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "ppo"},
    "training": {**TRAINING_ROLLOUT, "shared_prefix_fanout": "off"},
    "ppo": {
        **REWARD,
        "updates": 3,
        "rollout_batch_size": 4,
        "ppo_epochs": 2,
        "clip_range": 0.1,
        "kl_coefficient": 0.05,
        "reference_kl_coefficient": 0.02,
        "critic": {
            "enabled": False,
            "gamma": 0.99,
            "gae_lambda": 0.9,
            "value_lr": 0.02,
            "value_epochs": 2,
            "feature_dtype": "bf16",
        },
        "sampling": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16, "seed": 3},
    },
    "observe": {"directory": "observe", "every": 2, "max_text_chars": 100, "enabled": False},
}

RULER = {
    "type": "ruler",
    "base_url": "http://127.0.0.1:8080/v1",
    "model": "judge-model",
    "api_key_env": "JUDGE_KEY",
    "rubric": TRICKY,
    "pairwise_rubric": "prefer the shorter answer",
    "temperature": 0.0,
    "max_concurrency": 2,
    "timeout_secs": 30.0,
    "max_retries": 1,
    "cache_path": "judge-cache.jsonl",
    "strategy": {
        "mode": "pairwise",
        "max_pairs": 6,
        "both_orders": False,
        "aggregation": "bradley_terry",
    },
    "context": {
        "max_request_chars": 50000,
        "max_trajectory_chars": 7000,
        "max_message_chars": 1500,
        "head_ratio": 0.5,
        "include_env_state": False,
    },
    "compaction": {"trigger_chars": 4000, "target_chars": 2000, "keep_last": 2},
}

GRPO = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "grpo"},
    "training": {**TRAINING_ROLLOUT, "rollout_backend": "llama_cpp", "rollout_is_cap": 3.0},
    "reference": {"model": "ref.gguf", "ctx": 512},
    "evaluation": {"data": "held.jsonl", "max_examples": 8, "patience": 2},
    "checkpoint": {"directory": "ckpt", "mode": "best_eval"},
    "grpo": {
        **REWARD,
        "updates": 3,
        "prompts_per_update": 2,
        "group_size": 4,
        "grpo_epochs": 2,
        "clip_range_low": 0.1,
        "clip_range_high": 0.3,
        "importance_sampling_level": "sequence",
        "kl_coefficient": 0.02,
        "mask_truncated": True,
        "baseline": "leave_one_out",
        "prompt_order": "shuffled",
        "max_stalled_updates": 3,
        "judge_weight": 0.5,
        "judge_failure": "fail",
        "max_judge_dropped_fraction": 0.25,
        "sampling": dict(SAMPLING),
        "overlong_penalty": {"buffer_tokens": 4, "max_penalty": 0.5},
        "kl_schedule": {"warmup_updates": 2, "target": 0.1},
        "dynamic_sampling": {"max_resample_factor": 3},
        "judge": RULER,
    },
}

DISTILL = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "distill"},
    "training": TRAINING_ROLLOUT,
    "distill": {
        "teacher_path": "teacher.gguf",
        "prompts": "prompts.jsonl",
        "updates": 2,
        "prompts_per_update": 2,
        "samples_per_prompt": 2,
        "distill_epochs": 2,
        "clip_range_low": 0.1,
        "clip_range_high": 0.3,
        "weight_clip": 3.0,
        "kl_coefficient": 0.1,
        "mask_truncated": True,
        "prompt_order": "shuffled",
        "sampling": dict(SAMPLING),
    },
    "reference": {"model": "ref.gguf"},
}

DISTILL_OFFLINE = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "distill"},
    "distill": {
        "mode": "topk_offline",
        "teacher_path": "teacher.gguf",
        "data": "corpus.jsonl",
        "sidecar": "corpus.topk",
        "offline_epochs": 3,
    },
}

PREFERENCE = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "preference"},
    "preference": {
        "data": "pairs.jsonl",
        "loss": "dpo",
        "beta": 0.2,
        "reference": "base",
        "label_smoothing": 0.1,
        "shuffle": False,
        "pairs_per_step": 2,
        "logps_drop_warn": 1.0,
    },
}

SIMPO = {
    "run": {"algorithm": "preference"},
    "model": {"path": "base.gguf"},
    "output": {"path": "out/a.gguf"},
    "lora": {"init_adapter": "start.gguf"},
    "preference": {"data": "pairs.jsonl", "loss": "simpo", "gamma_beta_ratio": 0.8},
}

FULL = {
    "run": {"algorithm": "sft"},
    "model": {"path": "base.gguf"},
    "output": {"path": "out/model.gguf", "kind": "model"},
    "training": {"trainable": "full", "optimizer": "muon", "master_weights": "f32"},
    "optimizer": {
        "muon": {
            "momentum": 0.9,
            "nesterov": False,
            "ns_steps": 3,
            "ns_epsilon": 1e-9,
            "fallback_learning_rate": 0.0005,
        }
    },
    "sft": {"data": "train.jsonl"},
}

HYBRID = {
    "model": {"path": "base.gguf"},
    "output": {"path": "out/t.gguf", "kind": "trainable"},
    "training": {"trainable": "hybrid", "chunked_cross_entropy": False},
    "run": {"algorithm": "sft", "verbose": True},
    "lora": {"rank": 2},
    "trainable": {"layers": "0..1", "norms": True},
    "sft": {"data": "train.jsonl"},
}

# the strategy keys another mode reads
RULER_CHUNKED = {**RULER, "strategy": {"mode": "chunked", "anchor": False}}
GRPO_CHUNKED = copy.deepcopy(GRPO)
GRPO_CHUNKED["grpo"]["judge"] = RULER_CHUNKED
GRPO_COMMAND = copy.deepcopy(GRPO)
GRPO_COMMAND["grpo"]["judge"] = {"type": "command", "command": ["judge", "--strict"]}

AGENT_COMMON = {
    "scenarios": "scenarios.jsonl",
    "updates": 2,
    "scenarios_per_update": 2,
    "group_size": 4,
    "epochs_per_update": 2,
    "max_turns": 3,
    "max_new_tokens_per_turn": 64,
    "max_trajectory_tokens": 200,
    "max_rollout_secs": 60.0,
    "end_on_no_tool_call": False,
    "max_failed_turns": 2,
    "truncation": "min_reward",
    "max_dropped_fraction": 0.25,
    "skip_empty_updates": True,
    "clip_range_low": 0.1,
    "clip_range_high": 0.3,
    "importance_sampling_level": "sequence",
    "kl_coefficient": 0.01,
    "system_suffix": TRICKY,
    "template_variables": {"enable_thinking": False},
    "seed": 9,
}

AGENT_CONTAINER = {
    **copy.deepcopy(HEAD),
    "run": {"algorithm": "agent_grpo"},
    "training": {"ctx": 256, "micro_batch": 64},
    "reference": {"model": "ref.gguf"},
    "observe": {"directory": "observe"},
    "agent": {
        **AGENT_COMMON,
        "judge_failure": "fail",
        "drop_degenerate_groups": True,
        "mcp_config": ["mcp.json", "more-mcp.json"],
        "mcp_servers": [
            {
                "name": "files",
                "command": ["npx", "server-files"],
                "env": {"MODE": "read only", "ÜBER": "1"},
                "allowed_tools": ["read_*"],
                "denied_tools": ["read_secret"],
                "required": False,
                "stateless": True,
                "tool_timeout_secs": 5.0,
                "max_tool_result_bytes": 1000,
                "cwd": "servers",
                "env_passthrough": ["LANG"],
            },
            {
                "name": "search",
                "url": "https://example.invalid/mcp",
                "headers": {"Authorization": "Bearer x"},
                "stateless": True,
            },
        ],
        "environment": {
            "type": "container",
            "profile": "custom",
            "image": "localhost/agent@sha256:0123",
            "allow_network": True,
            "cache_volume": "pip-cache",
            "setup_timeout_secs": 100.0,
            "verify_timeout_secs": 20.0,
            "limits": {
                "cpus": 2.0,
                "memory_mb": 2048,
                "pids": 64,
                "exec_timeout_secs": 10.0,
                "max_output_bytes": 4096,
            },
            "pool": {
                "max_live": 4,
                "min_idle": 1,
                "reuse": "workspace",
                "max_leases_per_container": 8,
            },
            "tools": {
                "default": "mine",
                "scenario_toolsets": ["python", "other set"],
                "files": ["tools.toml"],
                "tool": [
                    {
                        "id": "echo",
                        "version": 2,
                        "name": "say",
                        "description": TRICKY,
                        "input_schema": {
                            "type": "object",
                            "properties": {"text": {"type": "string"}},
                        },
                        "exec": {"argv": ["echo"], "protocol": "argv", "timeout_secs": 3},
                    },
                    {"id": "ls", "version": 1, "builtin": {"factory": "list_dir", "params": {}}},
                ],
                "toolset": {
                    "mine": {"include": ["base"], "tools": ["echo@2", "ls"], "deny": ["rm*"]},
                    "other set": {"tools": ["ls"]},
                },
            },
        },
        "judge": RULER,
        "collect_api": {
            "base_url": "https://api.example.invalid/v1",
            "model": "big",
            "api_key_env": "API_KEY",
            "timeout_secs": 30.0,
            "temperature": 0.3,
        },
        "scenario_generation": {
            "model": "gen",
            "base_url": "https://api.example.invalid/v1",
            "api_key_env": "API_KEY",
            "count": 10,
            "batch_size": 5,
            "min_difficulty": 2,
            "max_difficulty": 4,
            "custom_instructions": "short tasks",
            "seed": 3,
            "shuffle": False,
            "timeout_secs": 60.0,
            "max_retries": 1,
            "max_catalog_bytes": 1000,
        },
    },
}

AGENT_LOCAL = {
    "run": {"algorithm": "agent_grpo"},
    "model": {"path": "base.gguf"},
    "output": {"path": "out/a.gguf"},
    "lora": {},
    "agent": {
        "scenarios": "s.jsonl",
        "environment": {
            "type": "local",
            "allow_unsandboxed": True,
            "tools": {"default": "base"},
        },
        "judge": {"type": "command", "command": ["python3", "judge.py"], "timeout_secs": 5.0},
    },
}

AGENT_HTTP = {
    "run": {"algorithm": "agent_grpo"},
    "model": {"path": "base.gguf"},
    "output": {"path": "out/a.gguf"},
    "lora": {},
    "agent": {
        "scenarios": "s.jsonl",
        "group_size": 2,
        "environment": {
            "type": "http",
            "base_url": "https://env.example.invalid",
            "request_timeout_secs": 5.0,
            "connect_timeout_secs": 2.0,
            "pool_size": 4,
            "max_result_bytes": 100,
            "headers": {"X-Key": "v"},
        },
        "judge": RULER_CHUNKED,
    },
}

FULL_RUNS: dict[str, dict[str, Any]] = {
    "sft": SFT,
    "full": FULL,
    "partial": PARTIAL,
    "hybrid": HYBRID,
    "ppo": PPO,
    "grpo": GRPO,
    "grpo-chunked": GRPO_CHUNKED,
    "grpo-command": GRPO_COMMAND,
    "distill": DISTILL,
    "distill-offline": DISTILL_OFFLINE,
    "preference": PREFERENCE,
    "simpo": SIMPO,
    "agent-container": AGENT_CONTAINER,
    "agent-local": AGENT_LOCAL,
    "agent-http": AGENT_HTTP,
}
