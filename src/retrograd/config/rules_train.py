"""Rules about what is trained and how: trainable mode, [lora], [trainable], [output], the
optimizer tables, the token window, [reference], [evaluation] and [checkpoint].

Each rule states the reference's sentence it enforces. Rules that need the model's tensor names
(selectors matching something) run later, in `selectors.py`.
"""

from __future__ import annotations

from collections.abc import Iterator

from retrograd.config.document import PINNED_ACCUMULATION
from retrograd.config.report import Issue
from retrograd.config.rule_base import Draft, issue, rule, set_value

ADAPTER_MODES = ("lora", "hybrid")
# output.kind values allowed per mode; the first is the default.
OUTPUT_KINDS = {
    "lora": ("adapter",),
    "full": ("trainable", "model"),
    "partial": ("trainable", "model"),
    "hybrid": ("trainable",),
}


def kl_term(d: Draft) -> tuple[str, str] | None:
    """(table, description) of the KL term that reads [reference], or None when there is none."""
    algorithm = d.algorithm
    if algorithm == "grpo" and d.need("grpo").kl_coefficient > 0:
        return "grpo", "grpo.kl_coefficient > 0"
    if algorithm == "ppo" and d.need("ppo").reference_kl_coefficient > 0:
        return "ppo", "ppo.reference_kl_coefficient > 0"
    if algorithm == "agent_grpo" and d.need("agent").kl_coefficient > 0:
        return "agent", "agent.kl_coefficient > 0"
    distill = d.need("distill") if algorithm == "distill" else None
    if distill is not None and distill.mode == "on_policy" and distill.kl_coefficient > 0:
        return "distill", "distill.kl_coefficient > 0"
    if algorithm == "preference" and d.need("preference").loss in ("dpo", "ipo"):
        return "preference", f"preference.loss = {d.need('preference').loss}"
    return None


def rollout_window(d: Draft) -> bool:
    """True when the optimizer window is pinned to one context (rollouts, preference pairs)."""
    if d.algorithm in PINNED_ACCUMULATION:
        return True
    distill = d.need("distill") if d.algorithm == "distill" else None
    return distill is not None and distill.mode == "on_policy"


@rule
def lora_per_mode(d: Draft) -> Iterator[Issue]:
    mode = d.mode
    if mode in ADAPTER_MODES and not d.present("lora"):
        yield issue(
            "lora",
            None,
            f'required when training.trainable = "{mode}"; add a [lora] section '
            "(an empty one takes the defaults)",
        )
    if mode not in ADAPTER_MODES and d.present("lora"):
        yield issue(
            "lora", None, f'refused when training.trainable = "{mode}": no adapter is trained'
        )


@rule
def trainable_per_mode(d: Draft) -> Iterator[Issue]:
    mode, section = d.mode, d.get("trainable")
    if mode in ("lora", "full"):
        if d.present("trainable"):
            what = "every float tensor" if mode == "full" else "only the adapter"
            yield issue(
                "trainable", None, f'refused when training.trainable = "{mode}" ({what} is trained)'
            )
        return
    if section is None:
        yield issue(
            "trainable",
            None,
            f'required when training.trainable = "{mode}": say which base tensors train',
        )
        return
    if mode == "hybrid":
        for name in ("modules", "output_head"):
            if section.is_set(name) and getattr(section, name):
                yield issue(
                    "trainable",
                    name,
                    "refused for hybrid, which trains only norms and biases next to the adapter",
                    getattr(section, name),
                )
        if not (section.norms or section.biases):
            yield issue(
                "trainable", None, "selects nothing: hybrid needs norms = true or biases = true"
            )
    elif not (section.modules or section.norms or section.output_head):
        yield issue(
            "trainable", None, "selects nothing: set modules, norms = true or output_head = true"
        )


@rule
def output_kind_per_mode(d: Draft) -> Iterator[Issue]:
    output, mode = d.get("output"), d.mode
    if output is None or output.kind is None:
        return
    allowed = OUTPUT_KINDS[mode]
    if output.kind not in allowed:
        yield issue(
            "output",
            "kind",
            f'not possible with training.trainable = "{mode}"; use ' + " or ".join(allowed),
            output.kind,
        )


@rule
def token_window(d: Draft) -> Iterator[Issue]:
    t = d.get("training")
    if rollout_window(d):
        if t.ctx % t.micro_batch:
            yield issue("training", "micro_batch", f"must divide ctx ({t.ctx})", t.micro_batch)
        elif (
            t.is_set("gradient_accumulation") and t.gradient_accumulation != t.ctx // t.micro_batch
        ):
            yield issue(
                "training",
                "gradient_accumulation",
                f"fixed to ctx / micro_batch ({t.ctx // t.micro_batch}) for {d.algorithm}; leave it out",
                t.gradient_accumulation,
            )
    elif t.ctx % (t.micro_batch * t.gradient_accumulation):
        yield issue(
            "training",
            "micro_batch",
            f"micro_batch x gradient_accumulation ({t.micro_batch * t.gradient_accumulation}) "
            f"must divide ctx ({t.ctx})",
            t.micro_batch,
        )


@rule
def generation_keys(d: Draft) -> Iterator[Issue]:
    t = d.get("training")
    generates = d.algorithm not in ("sft", "preference")
    if d.algorithm == "distill" and d.need("distill").mode == "topk_offline":
        generates = False
    if not generates:
        for name in ("generation_concurrency", "generation_batch"):
            if t.is_set(name):
                yield issue(
                    "training",
                    name,
                    f"read only by runs that generate; {d.algorithm} does not, remove it",
                    getattr(t, name),
                )
    # a run that scores no answers after a shared prompt: a value other than the default
    packs = generates or d.algorithm == "preference"
    if not packs and t.is_set("shared_prefix_fanout") and t.shared_prefix_fanout != "auto":
        yield issue(
            "training",
            "shared_prefix_fanout",
            "read only by runs that score answers sharing a prompt (ppo, grpo, on-policy "
            f"distill, agent_grpo, preference); {d.algorithm} does not, remove it",
            t.shared_prefix_fanout,
        )


# The runs llama.cpp samples for: the prompt-driven rollouts whose policy pass corrects for a
# sampler that is not the trainer (agentic GRPO keeps each trajectory's keys and values
# between turns, which only the in-process sampler does).
LLAMA_CPP_ALGORITHMS = ("ppo", "grpo")


_NOT_LLAMA_CPP = {
    "sft": "sft samples nothing",
    "preference": "preference samples nothing",
    "distill": "distill samples in_process in this version",
    "agent_grpo": "agent_grpo keeps keys and values between turns, which only in_process does",
}


@rule
def rollout_backend_keys(d: Draft) -> Iterator[Issue]:
    """rollout_backend = "llama_cpp" where llama.cpp can sample the answers: a prompt-driven
    rollout run of an adapter (llama.cpp applies a LoRA; trained base tensors would have to be
    written into a new model file after every step); rollout_is_cap only with it."""
    t = d.get("training")
    if t.rollout_backend == "in_process":
        if _changed(t, "rollout_is_cap"):
            yield issue(
                "training",
                "rollout_is_cap",
                'read only with rollout_backend = "llama_cpp" (the in-process sampler is the '
                "trainer); remove it",
                t.rollout_is_cap,
            )
        return
    if d.algorithm not in LLAMA_CPP_ALGORITHMS:
        yield issue(
            "training",
            "rollout_backend",
            f"samples the answers of ppo and grpo only; {_NOT_LLAMA_CPP.get(d.algorithm)}",
            t.rollout_backend,
        )
    if d.algorithm == "ppo" and d.need("ppo").sampling.temperature != 1.0:
        # GRPO enforces temperature 1; PPO scores at 1 whatever it samples at
        yield issue(
            "training",
            "rollout_backend",
            '"llama_cpp" needs [ppo.sampling].temperature = 1.0: its importance weights '
            "compare the trainer's temperature-1 probabilities with the sampler's",
            t.rollout_backend,
        )
    if d.mode != "lora":
        yield issue(
            "training",
            "rollout_backend",
            f'needs trainable = "lora" (llama.cpp applies the adapter; the '
            f"{d.mode} mode trains base tensors it would not see)",
            t.rollout_backend,
        )


# Keys read only when another key turns their feature on: (key, the switch, its wording).
# A value other than the default without the switch would be silently ignored, so it is refused.
SWITCHED_KEYS = (
    ("checkpoint_every_n_layers", "gradient_checkpointing", "gradient_checkpointing = true"),
    ("checkpoint_dtype", "gradient_checkpointing", "gradient_checkpointing = true"),
    ("chunked_ce_tiles", "chunked_cross_entropy", "chunked_cross_entropy = true"),
    ("chunked_ce_seq_chunk", "chunked_cross_entropy", "chunked_cross_entropy = true"),
)
# Muon's own keys act on 2-D base matrices; an adapter's factors all go to its AdamW fallback.
MUON_MATRIX_KEYS = ("momentum", "nesterov", "ns_steps", "ns_epsilon")


def _changed(section, name: str) -> bool:
    """True when the key holds a value other than its default (a default is never refused)."""
    return getattr(section, name) != type(section).model_fields[name].default


@rule
def switched_keys(d: Draft) -> Iterator[Issue]:
    t = d.get("training")
    for name, switch, wording in SWITCHED_KEYS:
        if not getattr(t, switch) and _changed(t, name):
            yield issue("training", name, f"needs {wording}", getattr(t, name))


@rule
def base_weight_keys(d: Draft) -> Iterator[Issue]:
    """Keys that act on trained base weights, refused where only an adapter trains."""
    t, mode = d.get("training"), d.mode
    if mode == "lora" and _changed(t, "master_weights"):
        yield issue(
            "training",
            "master_weights",
            'applies to trained f16/bf16 base weights; training.trainable = "lora" trains '
            "f32 adapter factors only, remove it",
            t.master_weights,
        )
    if t.optimizer == "muon" and mode in ADAPTER_MODES and _changed(t, "lr"):
        yield issue(
            "training",
            "lr",
            f'Muon updates no matrix when training.trainable = "{mode}": every adapter factor '
            "goes to AdamW at [optimizer.muon].fallback_learning_rate; set that and remove lr",
            t.lr,
        )
    muon = d.get("optimizer").muon
    if muon is None or mode not in ADAPTER_MODES:
        return
    for name in MUON_MATRIX_KEYS:
        if _changed(muon, name):
            yield issue(
                "optimizer.muon",
                name,
                f'Muon updates no matrix when training.trainable = "{mode}": every adapter '
                "factor goes to AdamW at fallback_learning_rate; remove it",
                getattr(muon, name),
            )


@rule
def optimizer_tables(d: Draft) -> Iterator[Issue]:
    t, tables = d.get("training"), d.get("optimizer")
    for name in ("muon", "gefen"):
        if getattr(tables, name) is not None and t.optimizer != name:
            yield issue(
                f"optimizer.{name}",
                None,
                f'read only with training.optimizer = "{name}", not "{t.optimizer}"; remove it',
            )
    lora = d.get("lora")
    # NOTE: gefen for an adapter is refused as unavailable (availability.py); its f32 rule
    # would only repeat that refusal, so it joins this one when gefen trains adapters.
    if t.optimizer == "muon" and d.mode in ADAPTER_MODES and lora is not None:
        if lora.dtype != "f32":
            yield issue(
                "lora",
                "dtype",
                f'{t.optimizer} updates f32 weights only; set lora.dtype = "f32" or use adamw',
                lora.dtype,
            )


@rule
def init_adapter_alone(d: Draft) -> Iterator[Issue]:
    lora = d.get("lora")
    if lora is None or lora.init_adapter is None:
        return
    for name in ("rank", "alpha", "seed", "targets", "dtype"):
        if lora.is_set(name):
            yield issue("lora", name, "comes from init_adapter; remove it", getattr(lora, name))
    checkpoint = d.get("checkpoint")
    if checkpoint is not None and checkpoint.resume_from is not None:
        yield issue(
            "checkpoint",
            "resume_from",
            "refused with lora.init_adapter: resume a checkpoint or start from an adapter, not both",
            checkpoint.resume_from,
        )
    if d.resume:
        yield issue(
            "lora",
            "init_adapter",
            "refused with --resume: resume a checkpoint or start from an adapter, not both",
            lora.init_adapter,
        )


@rule
def reference_section(d: Draft) -> Iterator[Issue]:
    reference, term = d.get("reference"), kl_term(d)
    if reference is not None and term is None:
        yield issue(
            "reference",
            None,
            f"refused: no KL term of this {d.algorithm} run reads it (PPO's kl_coefficient is "
            "toward the sampling policy; its reference_kl_coefficient > 0 reads [reference])",
        )
        return
    if reference is None and term is not None and d.mode != "lora" and d.algorithm != "preference":
        yield issue(
            "reference",
            None,
            f'required: training.trainable = "{d.mode}" changes the base weights, so with '
            f"{term[1]} the reference must be a separate model",
        )
    t = d.get("training")
    if reference is not None and reference.ctx is not None and reference.ctx < t.ctx:
        yield issue("reference", "ctx", f"must be at least training.ctx ({t.ctx})", reference.ctx)


@rule
def evaluation_keys(d: Draft) -> Iterator[Issue]:
    evaluation = d.get("evaluation")
    if evaluation is None or evaluation.max_examples is None:
        return
    if not rollout_window(d) or d.algorithm == "preference":
        yield issue(
            "evaluation",
            "max_examples",
            f"read only by rollout algorithms, not {d.algorithm}; remove it",
            evaluation.max_examples,
        )


@rule
def checkpoint_modes(d: Draft) -> Iterator[Issue]:
    checkpoint = d.get("checkpoint")
    if checkpoint is None:
        return
    best = checkpoint.mode in ("best_eval", "steps_and_best_eval")
    steps = checkpoint.mode in ("steps", "steps_and_best_eval")
    if best and not d.present("evaluation"):
        yield issue(
            "checkpoint",
            "mode",
            "needs an [evaluation] section to know what is best",
            checkpoint.mode,
        )
    offline = d.algorithm == "distill" and d.need("distill").mode == "topk_offline"
    if best and offline:
        yield issue(
            "checkpoint",
            "mode",
            "offline distillation runs no scheduled evaluation; use steps",
            checkpoint.mode,
        )
    if steps and checkpoint.every_steps is None:
        yield issue("checkpoint", "every_steps", f'required with mode = "{checkpoint.mode}"')
    if not steps and checkpoint.every_steps is not None:
        yield issue(
            "checkpoint",
            "every_steps",
            'refused with mode = "best_eval", which saves only the best evaluation',
            set_value(checkpoint, "every_steps"),
        )
