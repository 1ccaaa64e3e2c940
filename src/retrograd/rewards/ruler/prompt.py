"""What the RULER judge reads and what it may answer (formats.md §3.2, §3.4).

This module owns the prompt text (rubrics, the body of §3.2, the schema instruction), the
character budgets with head/tail elision, the response schemas and their validation, and the
presentation order of a request. It knows nothing about HTTP, caching or strategies: every
function is pure, so the same group always renders the same prompt (the cache key relies on it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from retrograd import nesting
from retrograd.config.judge import JudgeContext

LISTWISE_RUBRIC = (
    "Rank each trajectory relative to the others. Score goal achievement, efficiency, "
    "proportional granularity, and partial credit. Return one score in [0,1] per trajectory."
)
PAIRWISE_RUBRIC = (
    "Two trajectories attempted the same task. Decide which one is better on goal achievement, "
    "efficiency, and proportional granularity. Answer 'a', 'b', or 'tie'."
)

# Strict-mode schemas: every property required, no additional properties.
LISTWISE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "trajectory_id": {"type": "integer", "minimum": 0},
                    "explanation": {"type": "string"},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["trajectory_id", "explanation", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["scores"],
    "additionalProperties": False,
}
PAIRWISE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "winner": {"type": "string", "enum": ["a", "b", "tie"]},
        "explanation": {"type": "string"},
    },
    "required": ["winner", "explanation"],
    "additionalProperties": False,
}


GUIDED_EXPLANATION_CHARS = 240  # an explanation's bound under constrained decoding


def guided_listwise_schema(ids: Sequence[int]) -> dict[str, Any]:
    """The listwise schema an endpoint decoding under a grammar (`guided_json`) gets: one item
    per trajectory shown, in the order shown, with its id fixed and a bounded explanation, so
    that even a model that cannot follow the prompt answers something `parse_listwise` takes."""
    explanation = {"type": "string", "maxLength": GUIDED_EXPLANATION_CHARS}
    score = {"type": "number", "minimum": 0, "maximum": 1}
    item = {
        "type": "object",
        "properties": {"explanation": explanation, "score": score},
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    items = [
        dict(item, properties={"trajectory_id": {"const": i}, **item["properties"]}) for i in ids
    ]
    scores = {
        "type": "array",
        "prefixItems": items,
        "items": False,
        "minItems": len(items),
    }
    return dict(LISTWISE_SCHEMA, properties={"scores": scores})


def guided_pairwise_schema() -> dict[str, Any]:
    """The pairwise schema under a grammar: the explanation bounded."""
    explanation = {"type": "string", "maxLength": GUIDED_EXPLANATION_CHARS}
    return dict(
        PAIRWISE_SCHEMA, properties=dict(PAIRWISE_SCHEMA["properties"], explanation=explanation)
    )


class JudgeReplyError(ValueError):
    """A judge reply that §3.2 refuses; the client retries the request."""


@dataclass(frozen=True)
class Candidate:
    """One member of a group as the judge sees it: its messages (OpenAI chat format) and the
    environment's final state, if any."""

    messages: list[dict]
    final_state: str | None = None


# --- the shared opening -------------------------------------------------------------------


def split_shared(candidates: Sequence[Candidate]) -> tuple[list[dict], list[list[dict]]]:
    """The group's common opening messages (sent once as context) and each member's rest.

    NOTE: the shared part stops before any member's last message, so every member shows the
    judge at least one message of its own (a group of one, or of identical members, included).
    """
    if not candidates:
        return [], []
    lists = [c.messages for c in candidates]
    limit = min(len(m) for m in lists)
    limit = max(limit - 1, 0)
    shared = 0
    while shared < limit and all(m[shared] == lists[0][shared] for m in lists[1:]):
        shared += 1
    return [dict(m) for m in lists[0][:shared]], [list(m[shared:]) for m in lists]


# --- budgets ---------------------------------------------------------------------------------


def _marker(count: int) -> str:
    return f"[… {count} characters elided …]"


def elide(text: str, budget: int, head_ratio: float) -> str:
    """`text` in at most `budget` characters: its start (head_ratio of what is kept), a marker
    naming the elided count, and its end. The marker counts toward the budget."""
    if len(text) <= budget:
        return text
    # The marker's length for the largest possible count bounds the real one.
    keep = budget - len(_marker(len(text)))
    if keep <= 0:  # no room for a marker: the cut stays silent
        head = math.floor(budget * head_ratio)
        return text[:head] + text[len(text) - (budget - head) :]
    head = math.floor(keep * head_ratio)
    tail = keep - head
    return text[:head] + _marker(len(text) - keep) + text[len(text) - tail :]


def _content(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _joined(message: dict) -> dict:
    """A message whose content is a list of parts, with its text joined into one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "".join(
        str(p.get("text", "")) if isinstance(p, dict) and p.get("type") == "text"
        else f"[{p.get('type', 'part') if isinstance(p, dict) else 'part'}]"
        for p in content
    )  # fmt: skip
    return {**message, "content": text}


NAME_CHARS = 64  # a tool's name as the judge sees it: OpenAI's own limit on function names


def call_function(call: Any) -> dict | None:
    """A tool call's {"name", "arguments"} object, or None for a call without one (the
    trajectory may hold anything the policy wrote)."""
    fn = call.get("function") if isinstance(call, dict) else None
    return fn if isinstance(fn, dict) else None


def _fit_calls(calls: Any, ctx: JudgeContext) -> tuple[Any, bool]:
    """Tool calls with each one's name elided to NAME_CHARS and their arguments (as JSON
    text) sharing max_message_chars: with n calls in the message, each gets 1/n of it."""
    if not isinstance(calls, list) or not calls:
        return calls, False
    share = max(ctx.max_message_chars // len(calls), 1)
    out, cut = [], False
    for call in calls:
        fn = call_function(call)
        if fn is not None:
            fitted = dict(fn)
            name = fn.get("name")
            if isinstance(name, str) and len(name) > NAME_CHARS:
                fitted["name"] = elide(name, NAME_CHARS, ctx.head_ratio)
            if "arguments" in fn:
                args = fn["arguments"]
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                short = elide(text, share, ctx.head_ratio)
                if short != text:
                    fitted["arguments"] = short
            if fitted != fn:
                cut = True
                call = {**call, "function": fitted}
        out.append(call)
    return out, cut


def _calls_size(message: dict) -> int:
    """What a message's tool calls add to its trajectory: their names and arguments."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return 0
    size = 0
    for fn in filter(None, map(call_function, calls)):
        for key in ("name", "arguments"):
            value = fn.get(key)
            if value is not None:
                size += len(value) if isinstance(value, str) else len(quoted(value))
    return size


def _elide_trajectory(messages: list[dict], budget: int, head_ratio: float) -> list[dict]:
    """Drop the middle of a trajectory so its text totals at most about `budget` characters.

    A message's text is its content, then its tool calls' names and arguments; the trajectory's
    is all of theirs in order, cut as one text: the first head_ratio of what is kept from its
    start, the rest from its end. Messages wholly in the cut are dropped, except the first one
    the cut touches, which carries the marker; a partly cut message keeps its role and other
    fields, and its tool calls unless the cut covers all of them (so the total can pass the
    budget by the calls of the two messages at the cut's ends, each within max_message_chars).
    """
    sizes = [len(_content(m)) + _calls_size(m) for m in messages]
    total = sum(sizes)
    if total <= budget:
        return messages
    marker_len = len(_marker(total))  # bounds the real marker's length
    keep = budget - marker_len if budget > marker_len else budget
    head = math.floor(keep * head_ratio)
    cut_from, cut_to = head, total - (keep - head)  # the elided span of the joined text
    marker = _marker(cut_to - cut_from) if budget > marker_len else ""
    out: list[dict] = []
    start = 0
    marked = False
    for message, size in zip(messages, sizes, strict=True):
        text = _content(message)
        end = start + size
        calls_from = start + len(text)  # the calls' span: [calls_from, end)
        if end <= cut_from:
            out.append(message)  # wholly before the cut
        elif start >= cut_to and marked:
            out.append(message)  # wholly after the cut
        else:
            kept_head = text[: max(cut_from - start, 0)]
            kept_tail = text[max(cut_to - start, 0) :] if calls_from > cut_to else ""
            has_calls = calls_from < end
            calls_kept = has_calls and (calls_from < cut_from or end > cut_to)
            kept = {**message, "content": kept_head + kept_tail}
            if has_calls and not calls_kept:
                del kept["tool_calls"]
            if not marked:
                kept["content"] = kept_head + marker + kept_tail
                out.append(kept)
                marked = True
            elif kept_head or kept_tail or calls_kept:
                out.append(kept)
        start = end
    return out


def fit(messages: list[dict], ctx: JudgeContext) -> tuple[list[dict], bool]:
    """`messages` within the budgets of `ctx`: each message's content at most
    max_message_chars, then all contents together at most max_trajectory_chars, both elided in
    the middle. Returns the fitted copy and whether anything was elided.

    A content given as parts counts as its text parts joined (other parts as "[type]"); a
    message's tool calls share max_message_chars for their arguments (names elided to
    NAME_CHARS), and their names and arguments count toward the trajectory's total. The
    request budget is the strategy's business (it decides chunking
    from the rendered prompt's length).
    """
    elided = False
    fitted: list[dict] = []
    for message in messages:
        message = _joined(message)
        text = _content(message)
        short = elide(text, ctx.max_message_chars, ctx.head_ratio)
        if short != text:
            elided = True
            message = {**message, "content": short}
        calls, cut = _fit_calls(message.get("tool_calls"), ctx)
        if cut:
            elided = True
            message = {**message, "tool_calls": calls}
        fitted.append(message)
    trimmed = _elide_trajectory(fitted, ctx.max_trajectory_chars, ctx.head_ratio)
    return trimmed, elided or trimmed is not fitted


# --- prompts ---------------------------------------------------------------------------------


def quoted(value: Any) -> str:
    """`value` as JSON text with every "</" written "<\\/" (the same JSON value): text the policy
    wrote cannot close the prompt's <context>, <trajectories> or <transcript> tag early."""
    return json.dumps(value, ensure_ascii=False).replace("</", "<\\/")


def _entry(messages: list[dict], final_state: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"messages": messages}
    if final_state is not None:
        entry["final_state"] = final_state
    return entry


def schema_instruction(schema: dict[str, Any]) -> str:
    """The closing line of every prompt: answer with one JSON object matching `schema`."""
    return (
        "Answer with one JSON object matching this JSON schema, and nothing else:\n"
        + json.dumps(schema, ensure_ascii=False)
    )


def _body(rubric: str, shared: list[dict], trajectories: Any, schema: dict[str, Any]) -> str:
    return (
        f"{rubric}\n\n<context>\n{quoted(shared)}\n</context>\n\n"
        f"<trajectories>\n{quoted(trajectories)}\n</trajectories>\n\n{schema_instruction(schema)}"
    )


def listwise_prompt(
    rubric: str, shared: list[dict], items: Sequence[tuple[int, list[dict], str | None]]
) -> str:
    """A listwise request: `items` are (trajectory_id, messages, final_state) in presentation
    order; a None final_state is left out."""
    trajectories = [{"trajectory_id": i, **_entry(m, s)} for i, m, s in items]
    return _body(rubric, shared, trajectories, LISTWISE_SCHEMA)


def _side(side: Candidate | tuple[list[dict], str | None]) -> dict[str, Any]:
    if isinstance(side, Candidate):
        return _entry(side.messages, side.final_state)
    messages, final_state = side
    return _entry(messages, final_state)


def pairwise_prompt(
    rubric: str,
    shared: list[dict],
    a: Candidate | tuple[list[dict], str | None],
    b: Candidate | tuple[list[dict], str | None],
) -> str:
    """A pairwise request: `a` and `b` as Candidates or (messages, final_state) pairs; the
    trajectories carry no ids, only their positions "a" and "b"."""
    return _body(rubric, shared, {"a": _side(a), "b": _side(b)}, PAIRWISE_SCHEMA)


# --- replies ---------------------------------------------------------------------------------


def extract_json(text: str) -> dict[str, Any]:
    """The JSON object in a reply, from its first "{" to its last "}", so prose and markdown
    fences around it are tolerated."""
    first, last = text.find("{"), text.rfind("}")
    if first < 0 or last < first:
        raise JudgeReplyError("the reply holds no JSON object")
    try:
        obj = nesting.loads(text[first : last + 1])
    except json.JSONDecodeError as err:  # nested too deep (nesting.TooDeep) included
        raise JudgeReplyError(f"the reply's JSON does not parse: {err}") from None
    if not isinstance(obj, dict):
        raise JudgeReplyError("the reply's JSON is not an object")
    return obj


def _unknown(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise JudgeReplyError(f'{where}: unknown field "{extra[0]}"')


def _score_item(item: Any, k: int) -> tuple[int, float]:
    where = f"scores[{k}]"
    if not isinstance(item, dict):
        raise JudgeReplyError(f"{where}: not an object")
    _unknown(item, {"trajectory_id", "explanation", "score"}, where)
    tid, score = item.get("trajectory_id"), item.get("score")
    if isinstance(tid, float) and tid.is_integer():
        tid = int(tid)  # JSON Schema's "integer" admits 2.0
    if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
        raise JudgeReplyError(f"{where}: trajectory_id must be an integer of at least 0")
    if "explanation" in item and not isinstance(item["explanation"], str):
        raise JudgeReplyError(f"{where}: explanation must be a string")
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise JudgeReplyError(f"{where}: score must be a number")
    if not 0.0 <= score <= 1.0:  # NaN fails too
        raise JudgeReplyError(f"{where}: score {score} is outside [0, 1]")
    return tid, float(score)


def parse_listwise(obj: dict[str, Any], ids: Collection[int]) -> dict[int, float]:
    """The scores of a listwise reply by trajectory_id. Refuses unknown fields, a score outside
    [0, 1], and ids that do not cover `ids` exactly once. A missing explanation is tolerated."""
    _unknown(obj, {"scores"}, "reply")
    items = obj.get("scores")
    if not isinstance(items, list):
        raise JudgeReplyError('reply: "scores" must be an array')
    expected = set(ids)
    scores: dict[int, float] = {}
    for k, item in enumerate(items):
        tid, score = _score_item(item, k)
        if tid in scores:
            raise JudgeReplyError(f"scores[{k}]: trajectory_id {tid} scored twice")
        if tid not in expected:
            raise JudgeReplyError(f"scores[{k}]: trajectory_id {tid} is not in the request")
        scores[tid] = score
    missing = sorted(expected - set(scores))
    if missing:
        raise JudgeReplyError(f"reply: trajectory_id {missing[0]} has no score")
    return scores


def parse_pairwise(obj: dict[str, Any]) -> str:
    """The winner of a pairwise reply: "a", "b" or "tie" (case and spaces ignored). Extra
    fields are tolerated."""
    winner = obj.get("winner")
    if not isinstance(winner, str) or winner.strip().lower() not in ("a", "b", "tie"):
        raise JudgeReplyError(f'reply: winner must be "a", "b" or "tie", got {winner!r}')
    return winner.strip().lower()


# --- presentation order ----------------------------------------------------------------------

_MASK = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64 (Steele, Lea, Flood 2014): (next state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return state, z ^ (z >> 31)


def permutation(group_id: int, request_index: int, n: int) -> list[int]:
    """Presentation order of a request of `n` items: position k shows item order[k].

    Fisher-Yates driven by splitmix64, seeded by the group's mixed id xor the request index,
    so every (group, request) has its own order and reruns repeat it.
    """
    _, mixed = _splitmix64(group_id & _MASK)
    state = mixed ^ (request_index & _MASK)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        state, r = _splitmix64(state)
        j = r % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order
