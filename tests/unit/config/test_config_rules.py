"""Cross-section rules: for each, a valid file passes and a broken one fails with its message."""

from __future__ import annotations

import pytest
from config_runs import run_doc

from retrograd.config import validate_run
from retrograd.errors import ConfigError

FULL = {"trainable": "full"}


def errors_of(doc, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_run(doc, **kwargs)
    return str(caught.value)


# an offline distillation run's [distill], patched over run_doc("distill")'s
OFFLINE_DISTILL = {
    "mode": "topk_offline",
    "data": "c.jsonl",
    "sidecar": "c.topk",
    "prompts": None,
    "updates": None,
    "prompts_per_update": None,
    "sampling": None,
}


# (name, valid document, broken document, expected line of the broken one)
CASES = [
    (
        "lora required for lora mode",
        run_doc(),
        run_doc(lora=None),
        'run.toml: [lora]: required when training.trainable = "lora"',
    ),
    (
        "lora refused for full",
        run_doc(lora=None, training=FULL),
        run_doc(training=FULL),
        'run.toml: [lora]: refused when training.trainable = "full"',
    ),
    (
        "trainable refused for lora",
        run_doc(),
        run_doc(trainable={"norms": True}),
        'run.toml: [trainable]: refused when training.trainable = "lora"',
    ),
    (
        "partial needs a selector",
        run_doc(lora=None, training={"trainable": "partial"}, trainable={"modules": "attn"}),
        run_doc(lora=None, training={"trainable": "partial"}, trainable={"biases": True}),
        "run.toml: [trainable]: selects nothing: set modules, norms = true or output_head = true",
    ),
    (
        "hybrid allows only norms and biases",
        run_doc(training={"trainable": "hybrid"}, trainable={"norms": True}),
        run_doc(training={"trainable": "hybrid"}, trainable={"norms": True, "modules": "attn"}),
        'run.toml: [trainable].modules = ["attn"]: refused for hybrid',
    ),
    (
        "output kind per mode",
        run_doc(lora=None, training=FULL, output={"kind": "model"}),
        run_doc(lora=None, training=FULL, output={"kind": "adapter"}),
        'run.toml: [output].kind = "adapter": not possible with training.trainable = "full"; '
        "use trainable or model",
    ),
    (
        "hybrid output cannot be a model",
        run_doc(training={"trainable": "hybrid"}, trainable={"norms": True}),
        run_doc(
            training={"trainable": "hybrid"}, trainable={"norms": True}, output={"kind": "model"}
        ),
        'run.toml: [output].kind = "model": not possible with training.trainable = "hybrid"',
    ),
    (
        "micro_batch x accumulation divides ctx",
        run_doc(training={"ctx": 256, "micro_batch": 64, "gradient_accumulation": 4}),
        run_doc(training={"ctx": 256, "micro_batch": 64, "gradient_accumulation": 3}),
        "run.toml: [training].micro_batch = 64: micro_batch x gradient_accumulation (192) must "
        "divide ctx (256)",
    ),
    (
        "rollout algorithms pin gradient_accumulation",
        run_doc("grpo", training={"ctx": 256, "micro_batch": 64}),
        run_doc("grpo", training={"ctx": 256, "micro_batch": 64, "gradient_accumulation": 2}),
        "run.toml: [training].gradient_accumulation = 2: fixed to ctx / micro_batch (4) for grpo; "
        "leave it out",
    ),
    (
        "preference pins gradient_accumulation",
        run_doc("preference"),
        run_doc("preference", training={"gradient_accumulation": 2}),
        "run.toml: [training].gradient_accumulation = 2: fixed to ctx / micro_batch (4)",
    ),
    (
        "muon needs an f32 adapter",
        run_doc(training={"optimizer": "muon"}, lora={"dtype": "f32"}),
        run_doc(training={"optimizer": "muon"}),
        'run.toml: [lora].dtype = "f16": muon updates f32 weights only',
    ),
    (
        "gefen reads only its own table",
        run_doc(lora=None, training=FULL | {"optimizer": "gefen"}, optimizer={"gefen": {}}),
        run_doc(lora=None, training=FULL | {"optimizer": "gefen"}, optimizer={"muon": {}}),
        'run.toml: [optimizer.muon]: read only with training.optimizer = "muon", not "gefen"',
    ),
    (
        "init_adapter excludes the other lora keys",
        run_doc(lora={"init_adapter": "a.gguf"}),
        run_doc(lora={"init_adapter": "a.gguf", "rank": 4}),
        "run.toml: [lora].rank = 4: comes from init_adapter; remove it",
    ),
    (
        "init_adapter excludes resume_from",
        run_doc(
            lora={"init_adapter": "a.gguf"},
            checkpoint={"directory": "c", "mode": "steps", "every_steps": 5},
        ),
        run_doc(
            lora={"init_adapter": "a.gguf"},
            checkpoint={
                "directory": "/c",
                "mode": "steps",
                "every_steps": 5,
                "resume_from": "/c/step.state",
            },
        ),
        'run.toml: [checkpoint].resume_from = "/c/step.state": refused with lora.init_adapter',
    ),
    (
        "reference required when base weights train with a KL penalty",
        run_doc(
            "grpo",
            lora=None,
            training=FULL,
            grpo={"kl_coefficient": 0.1},
            reference={"model": "r.gguf"},
        ),
        run_doc("grpo", lora=None, training=FULL, grpo={"kl_coefficient": 0.1}),
        'run.toml: [reference]: required: training.trainable = "full" changes the base weights',
    ),
    (
        "reference refused without a KL term",
        run_doc("grpo", grpo={"kl_coefficient": 0.1}, reference={"model": "r.gguf"}),
        run_doc("grpo", reference={"model": "r.gguf"}),
        "run.toml: [reference]: refused: no KL term of this grpo run reads it",
    ),
    (
        "reference refused for ppo",
        run_doc("ppo"),
        run_doc("ppo", reference={"model": "r.gguf"}),
        "run.toml: [reference]: refused: no KL term of this ppo run reads it",
    ),
    (
        "reference ctx at least training.ctx",
        run_doc("preference", reference={"model": "r.gguf", "ctx": 128}),
        run_doc("preference", reference={"model": "r.gguf", "ctx": 64}),
        "run.toml: [reference].ctx = 64: must be at least training.ctx (128)",
    ),
    (
        "preference keys per loss",
        run_doc("preference", preference={"loss": "simpo", "gamma_beta_ratio": 1.0}),
        run_doc("preference", preference={"loss": "simpo", "label_smoothing": 0.1}),
        "run.toml: [preference].label_smoothing = 0.1: read only by loss = dpo, not simpo; remove it",
    ),
    (
        "preference reference key vs section",
        run_doc("preference", preference={"reference": "initial"}),
        run_doc("preference", preference={"reference": "initial"}, reference={"model": "r.gguf"}),
        'run.toml: [preference].reference = "initial": the [reference] section names the reference model',
    ),
    (
        "distill keys per mode",
        run_doc(
            "distill",
            distill={
                "mode": "topk_offline",
                "data": "d",
                "sidecar": "s",
                "prompts": None,
                "updates": None,
                "prompts_per_update": None,
                "sampling": None,
            },
        ),
        run_doc("distill", distill={"mode": "topk_offline", "data": "d", "sidecar": "s"}),
        'run.toml: [distill].prompts = "p.jsonl": read only with mode = on_policy; remove it',
    ),
    (
        "judge_weight with a judge",
        run_doc("grpo", grpo={"judge_weight": 0.5, "judge": {"type": "command", "command": ["j"]}}),
        run_doc("grpo", grpo={"judge": {"type": "command", "command": ["j"]}}),
        "run.toml: [grpo].judge_weight: required with a [grpo.judge]",
    ),
    (
        "judge_weight without a judge",
        run_doc("grpo"),
        run_doc("grpo", grpo={"judge_weight": 0.5}),
        "run.toml: [grpo].judge_weight = 0.5: read only with a [grpo.judge]; remove it",
    ),
    (
        "grpo temperature enforced",
        run_doc("grpo"),
        run_doc("grpo", grpo={"sampling": {"temperature": 0.7}}),
        "run.toml: [grpo.sampling].temperature = 0.7: must be 1.0",
    ),
    (
        "grpo top_p enforced",
        run_doc("grpo"),
        run_doc("grpo", grpo={"sampling": {"top_p": 0.9}}),
        "run.toml: [grpo.sampling].top_p = 0.9: must be 1.0",
    ),
    (
        "overlong penalty within the budget",
        run_doc("grpo", grpo={"overlong_penalty": {"buffer_tokens": 16, "max_penalty": 1.0}}),
        run_doc("grpo", grpo={"overlong_penalty": {"buffer_tokens": 17, "max_penalty": 1.0}}),
        "run.toml: [grpo.overlong_penalty].buffer_tokens = 17: must be at most grpo.sampling.max_new_tokens (16)",
    ),
    (
        "kl schedule needs a KL",
        run_doc("grpo", grpo={"kl_coefficient": 0.1, "kl_schedule": {}}),
        run_doc("grpo", grpo={"kl_schedule": {"warmup_updates": 3}}),
        "run.toml: [grpo.kl_schedule]: needs grpo.kl_coefficient > 0",
    ),
    (
        "dynamic sampling factor at least 2",
        run_doc("grpo", grpo={"dynamic_sampling": {"max_resample_factor": 2}}),
        run_doc("grpo", grpo={"dynamic_sampling": {"max_resample_factor": 1}}),
        "run.toml: [grpo.dynamic_sampling].max_resample_factor = 1: must be at least 2",
    ),
    (
        "grpo clip range order",
        run_doc("grpo"),
        run_doc("grpo", grpo={"clip_range_high": 0.1}),
        "run.toml: [grpo].clip_range_high = 0.1: must be at least clip_range_low (0.2)",
    ),
    (
        "fan-out at most group_size",
        run_doc("grpo", training={"shared_prefix_fanout": 4}),
        run_doc("grpo", training={"shared_prefix_fanout": 5}),
        "run.toml: [training].shared_prefix_fanout = 5: must be at most grpo.group_size (4)",
    ),
    (
        "observe only for rollouts",
        run_doc("grpo", observe={"directory": "o"}),
        run_doc("sft", observe={"directory": "o"}),
        "run.toml: [observe]: only ppo, grpo and agent_grpo record rollouts, not sft; remove it",
    ),
    (
        "agent needs a judge or an environment",
        run_doc("agent_grpo"),
        run_doc("agent_grpo", agent={"judge": None}),
        "run.toml: [agent]: needs an [agent.judge], an [agent.environment], or both",
    ),
    (
        "mcp servers stateless beside an environment",
        run_doc(
            "agent_grpo",
            agent={
                "mcp_servers": [{"name": "t", "url": "http://x", "stateless": True}],
                "environment": {"type": "http", "base_url": "http://env"},
            },
        ),
        run_doc(
            "agent_grpo",
            agent={
                "mcp_servers": [{"name": "t", "url": "http://x"}],
                "environment": {"type": "http", "base_url": "http://env"},
            },
        ),
        "run.toml: [agent.mcp_servers][0].stateless = false: must be true when [agent.environment] is declared",
    ),
    (
        "mcp server command or url",
        run_doc("agent_grpo", agent={"mcp_servers": [{"name": "t", "command": ["s"]}]}),
        run_doc(
            "agent_grpo",
            agent={"mcp_servers": [{"name": "t", "command": ["s"], "url": "http://x"}]},
        ),
        "run.toml: [agent.mcp_servers][0]: needs exactly one of command (a local server) and url",
    ),
    (
        "a trajectory fits the context",
        run_doc("agent_grpo", agent={"max_trajectory_tokens": 64}),
        run_doc("agent_grpo", agent={"max_trajectory_tokens": 100000}),
        "run.toml: [agent].max_trajectory_tokens = 100000: must be at most training.ctx",
    ),
    (
        "container pool holds a group",
        run_doc(
            "agent_grpo",
            agent={
                "group_size": 4,
                "environment": {
                    "type": "container",
                    "tools": {"default": "base"},
                    "pool": {"max_live": 4},
                },
            },
        ),
        run_doc(
            "agent_grpo",
            agent={
                "group_size": 4,
                "environment": {
                    "type": "container",
                    "tools": {"default": "base"},
                    "pool": {"max_live": 3},
                },
            },
        ),
        "run.toml: [agent.environment.pool].max_live = 3: must be at least agent.group_size (4)",
    ),
    (
        "mcp server policy overlay needs mcp_config",
        run_doc(
            "agent_grpo",
            agent={"mcp_config": "mcp.json", "mcp_servers": [{"name": "t", "denied_tools": ["x"]}]},
        ),
        run_doc("agent_grpo", agent={"mcp_servers": [{"name": "t", "denied_tools": ["x"]}]}),
        "run.toml: [agent.mcp_servers][0]: needs exactly one of command (a local server) and "
        "url (a remote one), or agent.mcp_config",
    ),
    (
        "container custom profile needs an image",
        run_doc(
            "agent_grpo",
            agent={
                "environment": {
                    "type": "container",
                    "profile": "custom",
                    "image": "img",
                    "tools": {"default": "base"},
                }
            },
        ),
        run_doc(
            "agent_grpo",
            agent={
                "environment": {
                    "type": "container",
                    "profile": "custom",
                    "tools": {"default": "base"},
                }
            },
        ),
        'run.toml: [agent.environment].image: required with profile = "custom"',
    ),
    (
        "container tools need a known toolset",
        run_doc(
            "agent_grpo",
            agent={
                "environment": {
                    "type": "container",
                    "tools": {"default": "mine", "toolset": {"mine": {"include": ["base"]}}},
                }
            },
        ),
        run_doc(
            "agent_grpo",
            agent={"environment": {"type": "container", "tools": {"default": "pyhton"}}},
        ),
        'run.toml: [agent.environment.tools].default = "pyhton": unknown toolset pyhton',
    ),
    (
        "local environment must be acknowledged",
        run_doc(
            "agent_grpo",
            agent={
                "environment": {
                    "type": "local",
                    "allow_unsandboxed": True,
                    "tools": {"default": "base"},
                }
            },
        ),
        run_doc(
            "agent_grpo", agent={"environment": {"type": "local", "tools": {"default": "base"}}}
        ),
        "run.toml: [agent.environment].allow_unsandboxed = false: must be true",
    ),
    (
        "http pool at least group_size",
        run_doc(
            "agent_grpo",
            agent={
                "group_size": 4,
                "environment": {"type": "http", "base_url": "http://e", "pool_size": 4},
            },
        ),
        run_doc(
            "agent_grpo",
            agent={
                "group_size": 8,
                "environment": {"type": "http", "base_url": "http://e", "pool_size": 4},
            },
        ),
        "run.toml: [agent.environment].pool_size = 4: must be at least agent.group_size (8)",
    ),
    (
        "http base_url scheme",
        run_doc("agent_grpo", agent={"environment": {"type": "http", "base_url": "https://e"}}),
        run_doc("agent_grpo", agent={"environment": {"type": "http", "base_url": "e:80"}}),
        'run.toml: [agent.environment].base_url = "e:80": must start with http:// or https://',
    ),
    (
        "judge strategy keys per mode",
        run_doc(
            "agent_grpo",
            agent={
                "judge": {
                    "type": "ruler",
                    "command": None,
                    "base_url": "http://j",
                    "model": "m",
                    "strategy": {"mode": "pairwise", "max_pairs": 4},
                }
            },
        ),
        run_doc(
            "agent_grpo",
            agent={
                "judge": {
                    "type": "ruler",
                    "command": None,
                    "base_url": "http://j",
                    "model": "m",
                    "strategy": {"mode": "listwise", "max_pairs": 4},
                }
            },
        ),
        "run.toml: [agent.judge.strategy].max_pairs = 4: read only with mode = pairwise, not listwise",
    ),
    (
        "judge context budgets nest",
        run_doc(
            "agent_grpo",
            agent={
                "judge": {
                    "type": "ruler",
                    "command": None,
                    "base_url": "http://j",
                    "model": "m",
                    "context": {"max_trajectory_chars": 2000},
                }
            },
        ),
        run_doc(
            "agent_grpo",
            agent={
                "judge": {
                    "type": "ruler",
                    "command": None,
                    "base_url": "http://j",
                    "model": "m",
                    "context": {"max_trajectory_chars": 1000},
                }
            },
        ),
        "run.toml: [agent.judge.context].max_trajectory_chars = 1000: budgets must nest",
    ),
    (
        "judge compaction target below trigger",
        run_doc(
            "grpo",
            grpo={
                "judge_weight": 1.0,
                "judge": {
                    "type": "ruler",
                    "command": None,
                    "base_url": "http://j",
                    "model": "m",
                    "compaction": {"trigger_chars": 100, "target_chars": 50, "keep_last": 1},
                },
            },
        ),
        run_doc(
            "grpo",
            grpo={
                "judge_weight": 1.0,
                "judge": {
                    "type": "ruler",
                    "command": None,
                    "base_url": "http://j",
                    "model": "m",
                    "compaction": {"trigger_chars": 100, "target_chars": 100, "keep_last": 1},
                },
            },
        ),
        "run.toml: [grpo.judge.compaction].target_chars = 100: must be less than trigger_chars (100)",
    ),
    (
        "command judge has no strategy",
        run_doc("agent_grpo"),
        run_doc("agent_grpo", agent={"judge": {"strategy": {"mode": "auto"}}}),
        'run.toml: [agent.judge].strategy = { mode = "auto" }: read only with type = ruler; remove it',
    ),
    (
        "best checkpoints need evaluation",
        run_doc(checkpoint={"directory": "c", "mode": "best_eval"}, evaluation={"data": "e.jsonl"}),
        run_doc(checkpoint={"directory": "c", "mode": "best_eval"}),
        'run.toml: [checkpoint].mode = "best_eval": needs an [evaluation] section',
    ),
    (
        "step checkpoints need every_steps",
        run_doc(checkpoint={"directory": "c", "mode": "steps", "every_steps": 10}),
        run_doc(checkpoint={"directory": "c", "mode": "steps"}),
        'run.toml: [checkpoint].every_steps: required with mode = "steps"',
    ),
    (
        "best_eval refuses every_steps",
        run_doc(checkpoint={"directory": "c", "mode": "best_eval"}, evaluation={"data": "e"}),
        run_doc(
            checkpoint={"directory": "c", "mode": "best_eval", "every_steps": 10},
            evaluation={"data": "e"},
        ),
        'run.toml: [checkpoint].every_steps = 10: refused with mode = "best_eval"',
    ),
    (
        "threads = 0 refused",
        run_doc(training={"threads": 2}),
        run_doc(training={"threads": 0}),
        "run.toml: [training].threads = 0: 0 is refused; leave threads out to choose automatically",
    ),
    (
        "checkpoint_dtype needs gradient checkpointing",
        run_doc(training={"gradient_checkpointing": True, "checkpoint_dtype": "bf16"}),
        run_doc(training={"checkpoint_dtype": "bf16"}),
        'run.toml: [training].checkpoint_dtype = "bf16": needs gradient_checkpointing = true',
    ),
    (
        "template variables reserved names",
        run_doc(sft={"template_variables": {"enable_thinking": False}}),
        run_doc(sft={"template_variables": {"messages": []}}),
        "run.toml: [sft].template_variables = { messages = [] }: messages is set by Retrograd itself",
    ),
    (
        "gefen block size power of two",
        run_doc(
            lora=None,
            training=FULL | {"optimizer": "gefen"},
            optimizer={"gefen": {"block_size": 512}},
        ),
        run_doc(
            lora=None,
            training=FULL | {"optimizer": "gefen"},
            optimizer={"gefen": {"block_size": 1000}},
        ),
        "run.toml: [optimizer.gefen].block_size = 1000: must be a power of two",
    ),
    (
        "generation keys only for runs that generate",
        run_doc("grpo", training={"generation_concurrency": 4}),
        run_doc("sft", training={"generation_concurrency": 4}),
        "run.toml: [training].generation_concurrency = 4: read only by runs that generate",
    ),
    (
        "generation batch at least 1",
        run_doc("grpo", training={"generation_batch": 1}),
        run_doc("grpo", training={"generation_batch": 0}),
        "run.toml: [training].generation_batch = 0: must be at least 1",
    ),
    (
        "generation batch only for runs that generate: preference",
        run_doc("ppo", training={"generation_batch": 4}),
        run_doc("preference", training={"generation_batch": 4}),
        "run.toml: [training].generation_batch = 4: read only by runs that generate; "
        "preference does not",
    ),
    (
        "generation batch only for runs that generate: offline distillation",
        run_doc("distill", training={"generation_batch": 4}),
        run_doc(
            "distill",
            training={"generation_batch": 4},
            distill=OFFLINE_DISTILL,
        ),
        "run.toml: [training].generation_batch = 4: read only by runs that generate; "
        "distill does not",
    ),
    (
        "llama_cpp backend not for distillation",
        run_doc("grpo", training={"rollout_backend": "llama_cpp"}),
        run_doc("distill", training={"rollout_backend": "llama_cpp"}),
        'run.toml: [training].rollout_backend = "llama_cpp": samples the answers of ppo and '
        "grpo only; distill samples in_process in this version",
    ),
    (
        "llama_cpp backend not for agentic GRPO",
        run_doc("grpo", training={"rollout_backend": "llama_cpp"}),
        run_doc("agent_grpo", training={"rollout_backend": "llama_cpp"}),
        'run.toml: [training].rollout_backend = "llama_cpp": samples the answers of ppo and '
        "grpo only; agent_grpo keeps keys and values between turns",
    ),
    (
        "llama_cpp backend for PPO at temperature 1",
        run_doc(
            "ppo", training={"rollout_backend": "llama_cpp"}, ppo={"sampling": {"temperature": 1.0}}
        ),
        run_doc("ppo", training={"rollout_backend": "llama_cpp"}),  # at 0.7
        'run.toml: [training].rollout_backend = "llama_cpp": "llama_cpp" needs '
        "[ppo.sampling].temperature = 1.0",
    ),
    (
        "llama_cpp backend only for an adapter",
        run_doc("grpo", training={"rollout_backend": "llama_cpp"}),
        run_doc("grpo", training={**FULL, **{"rollout_backend": "llama_cpp"}}, lora=None),
        'run.toml: [training].rollout_backend = "llama_cpp": needs trainable = "lora" '
        "(llama.cpp applies the adapter; the full mode trains base tensors it would not see)",
    ),
    (
        "rollout_is_cap only with the llama_cpp backend",
        run_doc("grpo", training={**{"rollout_backend": "llama_cpp"}, "rollout_is_cap": 3.0}),
        run_doc("grpo", training={"rollout_is_cap": 3.0}),
        '[training].rollout_is_cap = 3.0: read only with rollout_backend = "llama_cpp"',
    ),
    (
        "rollout_is_cap at least 1",
        run_doc("grpo", training={**{"rollout_backend": "llama_cpp"}, "rollout_is_cap": 1.0}),
        run_doc("grpo", training={**{"rollout_backend": "llama_cpp"}, "rollout_is_cap": 0.9}),
        "[training].rollout_is_cap = 0.9: must be at least 1",
    ),
    (
        "max_examples only for rollouts",
        run_doc("grpo", evaluation={"data": "e", "max_examples": 4}),
        run_doc("sft", evaluation={"data": "e", "max_examples": 4}),
        "run.toml: [evaluation].max_examples = 4: read only by rollout algorithms, not sft",
    ),
]


@pytest.mark.parametrize(
    ("doc", "refused"),
    [
        (run_doc("sft", training={"shared_prefix_fanout": "auto"}), None),  # the default
        (run_doc("sft", training={"shared_prefix_fanout": "off"}), "sft"),
        (
            run_doc("distill", training={"shared_prefix_fanout": "off"}, distill=OFFLINE_DISTILL),
            "distill",
        ),
        (run_doc("ppo", training={"shared_prefix_fanout": "off"}), None),
        (run_doc("distill", training={"shared_prefix_fanout": "off"}), None),  # on-policy
        (run_doc("agent_grpo", training={"shared_prefix_fanout": "off"}), None),
        (run_doc("preference", training={"shared_prefix_fanout": 2}), None),
    ],
    ids=["sft-default", "sft", "offline-distill", "ppo", "on-policy", "agent", "preference"],
)
def test_shared_prefix_fanout_is_refused_where_no_answers_share_a_prompt(doc, refused):
    """Every loop that scores answers after their prompt reads it; a run that scores none
    refuses a value other than the default, naming the loops that read it."""
    if refused is None:
        validate_run(doc)
        return
    value = doc["training"]["shared_prefix_fanout"]
    assert errors_of(doc).splitlines() == [
        f'run.toml: [training].shared_prefix_fanout = "{value}": read only by runs that score '
        "answers sharing a prompt (ppo, grpo, on-policy distill, agent_grpo, preference); "
        f"{refused} does not, remove it"
    ]


@pytest.mark.parametrize(
    ("valid", "broken", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rule(valid, broken, expected):
    validate_run(valid)
    message = errors_of(broken)
    assert expected in message.splitlines()[0] or any(
        line.startswith(expected) for line in message.splitlines()
    ), message


def test_resume_refused_with_init_adapter():
    doc = run_doc(lora={"init_adapter": "a.gguf"})
    validate_run(doc, resume=False)
    assert "[lora].init_adapter" in errors_of(doc, resume=True)
    assert "refused with --resume" in errors_of(doc, resume="ckpt/step-1.state")


def test_derived_defaults_are_filled_in():
    config = validate_run(run_doc("preference", preference={"loss": "simpo"}, reference=None))
    assert config.output.kind == "adapter"
    assert config.preference.effective_beta == 2.0
    config = validate_run(run_doc(training={"optimizer": "muon"}, lora={"dtype": "f32"}))
    assert config.optimizer.muon is not None and config.optimizer.muon.ns_steps == 5
    config = validate_run(run_doc("preference", reference={"model": "r.gguf"}))
    assert config.reference.ctx == config.training.ctx == 128
