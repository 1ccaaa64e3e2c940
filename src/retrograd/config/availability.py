"""What this version does with each key of the run file at run time: the "At run time" column.

Every key of the configuration reference validates, but not every key has its code yet. Each
key is one of:
- honoured: the commands that read it (train, bench, chat, serve) do what it says;
- read elsewhere: no effect on an sft run, honoured by the commands named (chat, serve);
- not read: a rule refuses it where the run would ignore it (a generation key in an sft run,
  a Muon matrix key with an adapter) and says what to do instead;
- unavailable: a value this version cannot honour, refused when the file is loaded, naming
  the key and what to do instead (a default value is never refused);
- later: a key of an algorithm or trainable mode that validates but does not train yet;
  `retrograd train` refuses the algorithm or the mode itself (none in this version: every
  algorithm and mode trains).

`ENTRIES` holds the column for every key (or whole table, under "*"); `docs.py` prints it and
tests/unit/config/test_config_availability.py checks it against `validate_run`. The rule that
refuses unavailable values is here too, so that the table and the refusal cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from retrograd.config.report import Issue
from retrograd.config.rule_base import Draft, issue, rule
from retrograd.config.rules_train import SWITCHED_KEYS

HONOURED = "honoured"
ELSEWHERE = "elsewhere"
NOT_READ = "not read"
UNAVAILABLE = "unavailable"
LATER = "later"
KINDS = (HONOURED, ELSEWHERE, NOT_READ, UNAVAILABLE, LATER)


@dataclass(frozen=True)
class Availability:
    kind: str  # one of KINDS
    column: str  # the cell of docs/configuration.md's "At run time" column


def _entry(kind: str, column: str = "") -> Availability:
    return Availability(kind, column or kind)


YES = _entry(HONOURED)
# Keys of an algorithm whose loop is not in this version: train refuses the algorithm.
_LATER_ALGORITHM: dict[str, Availability] = {}
_ROLLOUTS = (
    "refused for sft, preference and offline distill; honoured by ppo, grpo, on-policy distill "
    "and agent_grpo"
)

# (table, key) -> its column; (table, "*") covers a whole table and the tables inside it.
ENTRIES: dict[tuple[str, str], Availability] = {
    ("run", "algorithm"): _entry(
        HONOURED,
        "sft, ppo, grpo, preference, distill and agent_grpo train",
    ),
    ("run", "verbose"): _entry(HONOURED, "honoured: extra lines on stderr"),
    ("model", "path"): YES,
    ("model", "device"): YES,
    ("output", "path"): YES,
    ("output", "kind"): _entry(
        HONOURED,
        "honoured: adapter (lora), trainable (full, partial, hybrid), model (full, partial)",
    ),
    ("lora", "rank"): YES,
    ("lora", "alpha"): YES,
    ("lora", "seed"): YES,
    ("lora", "targets"): YES,
    ("lora", "dtype"): _entry(
        HONOURED, "honoured: the exported adapter's type (the factors train in f32)"
    ),
    ("lora", "init_adapter"): YES,
    ("trainable", "*"): _entry(HONOURED, "honoured by partial and hybrid runs of every algorithm"),
    ("training", "trainable"): _entry(
        HONOURED,
        "honoured by every algorithm (a KL penalty toward the base needs [reference] once "
        "base tensors train)",
    ),
    ("training", "optimizer"): _entry(
        HONOURED,
        "adamw, sgd and muon honoured; gefen honoured for base tensors (full, partial), "
        "refused for an adapter (not available in this version)",
    ),
    **{
        ("training", name): YES
        for name in (
            "lr_scheduler",
            "warmup_steps",
            "weight_decay",
            "max_grad_norm",
            "epochs",
            "ctx",
            "micro_batch",
            "gradient_accumulation",
            "gradient_checkpointing",
            "chunked_cross_entropy",
        )
    },
    ("training", "parallel"): _entry(
        HONOURED,
        "honoured under torchrun by sft, preference, offline distill (ddp or fsdp2) and the "
        "rollout loops (ddp; they refuse fsdp2)",
    ),
    ("training", "dist_timeout_seconds"): _entry(HONOURED, "honoured under torchrun"),
    ("training", "lr"): _entry(
        HONOURED,
        "honoured; refused with muon and an adapter, whose factors train at "
        "[optimizer.muon].fallback_learning_rate",
    ),
    ("training", "threads"): _entry(
        HONOURED, "honoured by train, bench, chat and serve (RETRO_THREADS overrides it)"
    ),
    ("training", "generation_concurrency"): _entry(NOT_READ, _ROLLOUTS),
    ("training", "generation_batch"): _entry(
        NOT_READ,
        f"{_ROLLOUTS}: prompt positions per prefill pass",
    ),
    ("training", "shared_prefix_fanout"): _entry(
        NOT_READ,
        "refused for sft and offline distill; ppo, grpo, on-policy "
        "distill and agent_grpo honour auto (a group's "
        "answers scored after one pass over their prompt, as many as fit micro_batch; ppo "
        "samples one answer a prompt, so rows) and off, and `train` "
        "refuses max and numbers (not available in this version); preference honours auto, "
        "off, max and 2 "
        "(a pair's two answers after one prompt pass; more than 2 refused)",
    ),
    ("training", "fast_sampling_context"): _entry(
        ELSEWHERE,
        "read by ppo, grpo, on-policy distill, agent_grpo, bench, chat, serve and the run "
        "server's live chat; sft, offline distill and preference sample nothing",
    ),
    ("training", "kv_dtype"): _entry(
        HONOURED,
        "honoured by sft and offline distill (the cache of a window's earlier passes; f32 when "
        "compute is f32) and by the sampler of ppo, grpo, on-policy distill, agent_grpo, bench, "
        "chat, serve and the run server's live chat with fast_sampling_context (f16 is 16 "
        "bits: bf16 on a bf16 compute "
        "path; exact sampling keeps f32); no effect on preference, which keeps no cache",
    ),
    ("training", "rollout_backend"): _entry(
        NOT_READ,
        "honoured by ppo and grpo; llama_cpp refused for sft, preference, distill and "
        "agent_grpo and with a trainable mode other than lora; one process only, on a CPU "
        "unless llama-cpp-python was built for the GPU (docs/sampling.md)",
    ),
    ("training", "rollout_is_cap"): _entry(
        NOT_READ, 'honoured with rollout_backend = "llama_cpp", refused without it'
    ),
    **{
        ("training", name): _entry(NOT_READ, f"honoured; other than the default, needs {switch}")
        for name, _, switch in SWITCHED_KEYS
    },
    ("training", "master_weights"): _entry(
        NOT_READ,
        "refused with lora (no base weight trains); honoured by full, partial and hybrid",
    ),
    ("training", "require_gpu_resident"): _entry(
        HONOURED, "honoured on a GPU: the start-up audit stops the run"
    ),
    ("training", "max_gpu_duty_cycle"): _entry(
        HONOURED,
        "honoured on a GPU (rest after each optimizer step); on a CPU accepted and reported "
        "inactive (gpu_duty_cycle_reason: cpu_backend)",
    ),
    ("optimizer.muon", "*"): _entry(
        NOT_READ,
        "refused with an adapter (Muon updates none of its factors); honoured by full and partial",
    ),
    ("optimizer.muon", "fallback_learning_rate"): _entry(
        HONOURED, "honoured: the AdamW rate of an adapter's factors"
    ),
    ("optimizer.gefen", "*"): _entry(
        HONOURED,
        "honoured by full and partial; gefen is refused for an adapter (not available in "
        "this version)",
    ),
    ("evaluation", "data"): YES,
    ("evaluation", "every_iterations"): YES,
    ("evaluation", "max_examples"): _entry(NOT_READ, _ROLLOUTS),
    ("evaluation", "patience"): YES,
    ("evaluation", "min_delta"): YES,
    ("checkpoint", "*"): YES,
    ("metrics", "*"): YES,
    ("observe", "*"): _entry(
        NOT_READ, "refused for sft, distill and preference; honoured by ppo, grpo and agent_grpo"
    ),
    ("reference", "*"): _entry(
        NOT_READ,
        "refused for sft; honoured by grpo, on-policy distill and agent_grpo (KL penalty), by "
        "ppo (reference_kl_coefficient > 0) and by preference (dpo and ipo)",
    ),
    ("reference", "ctx"): _entry(
        HONOURED,
        "checked (at least training.ctx); the reference scores the policy's sequences, none "
        "longer than training.ctx, and allocates no context of its own: every valid value "
        "scores them whole, as the default does",
    ),
    ("sft", "*"): YES,
    ("ppo", "*"): _entry(HONOURED, "honoured by ppo"),
    ("grpo", "*"): _entry(HONOURED, "honoured by grpo"),
    ("preference", "*"): _entry(HONOURED, "honoured by preference"),
    ("distill", "*"): _entry(HONOURED, "honoured by distill (both modes)"),
    ("agent", "*"): _entry(HONOURED, "honoured by agent_grpo"),
    **{(name, "*"): entry for name, entry in _LATER_ALGORITHM.items()},
    ("agent.collect_api", "*"): _entry(
        ELSEWHERE, "read by `retrograd collect --api`; `train` ignores it"
    ),
    ("agent.scenario_generation", "*"): _entry(
        ELSEWHERE, "read by `retrograd scenarios generate`; `train` ignores it"
    ),
}


def availability(table: str, key: str) -> Availability:
    """The entry of `[table].key`: its own, else its table's, else an enclosing table's."""
    return ENTRIES[entry_key(table, key)]


def entry_key(table: str, key: str) -> tuple[str, str]:
    """The key of ENTRIES that holds `[table].key`'s entry."""
    if (table, key) in ENTRIES:
        return table, key
    parts = table.split(".")
    while parts:
        if (".".join(parts), "*") in ENTRIES:
            return ".".join(parts), "*"
        parts.pop()
    raise KeyError(f"[{table}].{key}: no entry in config/availability.py; add one")


# -- values this version refuses -------------------------------------------------------------


@dataclass(frozen=True)
class Unavailable:
    """A value of a key this version cannot honour, and what to do instead."""

    table: str
    key: str
    refused: Callable[[Draft, Any], bool]  # (draft, value) -> refused
    instead: str


UNAVAILABLE_VALUES = (
    Unavailable(
        "training",
        "optimizer",
        lambda d, value: value == "gefen" and d.mode in ("lora", "hybrid"),
        "adapters train with adamw, sgd or muon",
    ),
)


@rule
def unavailable_values(d: Draft) -> Iterator[Issue]:
    for item in UNAVAILABLE_VALUES:
        first, *rest = item.table.split(".")
        section = d.get(first)
        for part in rest:
            section = getattr(section, part, None) if section is not None else None
        if section is None:
            continue
        value = getattr(section, item.key)
        if item.refused(d, value):
            yield issue(
                item.table,
                item.key,
                f"not available in this version ({item.instead})",
                value,
            )
