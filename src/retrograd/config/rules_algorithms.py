"""Rules between keys of one algorithm section ([grpo], [distill], [preference]) and between it
and [training] or [reference]. Judges (shared by grpo and agent) are checked in rules_agent.py.
"""

from __future__ import annotations

from collections.abc import Iterator

from retrograd.config.algorithms import PREFERENCE_LOSS_KEYS
from retrograd.config.report import Issue
from retrograd.config.rule_base import Draft, issue, rule

JUDGED_KEYS = ("judge_weight", "judge_failure", "max_judge_dropped_fraction")


def clip_order(table: str, section) -> Iterator[Issue]:
    if section.clip_range_high < section.clip_range_low:
        yield issue(
            table,
            "clip_range_high",
            f"must be at least clip_range_low ({section.clip_range_low})",
            section.clip_range_high,
        )


def group_fits(table: str, group_size: int, d: Draft) -> Iterator[Issue]:
    """A group must fit the optimizer window, and an exact fan-out cannot exceed the group."""
    t = d.get("training")
    window = t.micro_batch * (t.ctx // t.micro_batch)
    if group_size > window:
        yield issue(
            table,
            "group_size",
            f"must fit the optimizer window of {window} tokens (training.ctx)",
            group_size,
        )
    fanout = t.shared_prefix_fanout
    if isinstance(fanout, int) and fanout > group_size:
        yield issue(
            "training",
            "shared_prefix_fanout",
            f"must be at most {table}.group_size ({group_size})",
            fanout,
        )


@rule
def grpo_rules(d: Draft) -> Iterator[Issue]:
    if d.algorithm != "grpo":
        return
    g = d.need("grpo")
    yield from clip_order("grpo", g)
    yield from group_fits("grpo", g.group_size, d)
    penalty = g.overlong_penalty
    if penalty is not None and penalty.buffer_tokens > g.sampling.max_new_tokens:
        yield issue(
            "grpo.overlong_penalty",
            "buffer_tokens",
            f"must be at most grpo.sampling.max_new_tokens ({g.sampling.max_new_tokens})",
            penalty.buffer_tokens,
        )
    if g.kl_schedule is not None and g.kl_coefficient == 0:
        yield issue(
            "grpo.kl_schedule",
            None,
            "needs grpo.kl_coefficient > 0; remove the table or raise the coefficient",
        )
    if g.judge is None:
        for name in JUDGED_KEYS:
            if g.is_set(name):
                yield issue(
                    "grpo", name, "read only with a [grpo.judge]; remove it", getattr(g, name)
                )
    elif g.judge_weight is None:
        yield issue(
            "grpo",
            "judge_weight",
            "required with a [grpo.judge]: the weight of its verdict in the reward",
        )


@rule
def distill_rules(d: Draft) -> Iterator[Issue]:
    if d.algorithm != "distill":
        return
    distill = d.need("distill")
    if distill.mode == "on_policy":
        yield from clip_order("distill", distill)


@rule
def preference_rules(d: Draft) -> Iterator[Issue]:
    if d.algorithm != "preference":
        return
    p = d.need("preference")
    for name, losses in PREFERENCE_LOSS_KEYS.items():
        if p.is_set(name) and p.loss not in losses:
            yield issue(
                "preference",
                name,
                f"read only by loss = {' or '.join(losses)}, not {p.loss}; remove it",
                getattr(p, name),
            )
    if p.reference is None or p.loss not in ("dpo", "ipo"):
        return
    if d.present("reference"):
        yield issue(
            "preference",
            "reference",
            "the [reference] section names the reference model; remove this key",
            p.reference,
        )
    elif p.reference == "base" and d.mode != "lora":
        yield issue(
            "preference",
            "reference",
            f'the base model without adapter is the trained model when training.trainable = "{d.mode}"; '
            'use "initial" or a [reference] section',
            p.reference,
        )
