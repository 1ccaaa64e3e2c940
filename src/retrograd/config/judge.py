"""[grpo.judge] and [agent.judge]: a command or an OpenAI-compatible LLM (ruler) scores groups.

The two sections share this format; `type` selects the model. Rules between keys (strategy
keys of another mode, budgets that must nest) are in `rules_agent.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from retrograd.config.fields import Argv, FilePath, Section, Text, key, optional_key

StrategyMode = Literal["auto", "listwise", "chunked", "pairwise"]
# Strategy keys and the modes that read them.
STRATEGY_KEYS = {
    "anchor": ("auto", "chunked"),
    "max_pairs": ("pairwise",),
    "both_orders": ("pairwise",),
    "aggregation": ("pairwise",),
}


class JudgeStrategy(Section):
    """[<section>.judge.strategy]: how a group's answers are put to the judge."""

    mode: StrategyMode = key(
        "auto",
        "auto (one request per group, split into chunks when too long), listwise (always one "
        "request), chunked (always split) or pairwise (two answers per request: most reliable, "
        "most requests).",
    )
    anchor: bool = key(
        True, "auto and chunked: repeat one answer in every chunk so scores share one scale."
    )
    max_pairs: int | None = optional_key(
        "pairwise: comparisons per group; all pairs when left out.", ge=1
    )
    both_orders: bool = key(
        True, "pairwise: judge each pair in both orders to cancel position bias."
    )
    aggregation: Literal["win_rate", "bradley_terry"] = key(
        "win_rate",
        "pairwise: win_rate, or bradley_terry (better when max_pairs limits the comparisons).",
    )


class JudgeContext(Section):
    """[<section>.judge.context]: character budgets of one judge request."""

    max_request_chars: int = key(60000, "Most characters in one request.", ge=1)
    max_trajectory_chars: int = key(8000, "Most characters of one answer or trajectory.", ge=1)
    max_message_chars: int = key(2000, "Most characters of one message.", ge=1)
    head_ratio: float = key(
        0.4, "Share of an elided message kept from its start, in [0, 1].", ge=0, le=1
    )
    include_env_state: bool = key(True, "Show the environment's final state to the judge.")


class JudgeCompaction(Section):
    """[<section>.judge.compaction]: summarise the middle of long transcripts."""

    trigger_chars: int = key(description="Compact transcripts longer than this.", ge=1)
    target_chars: int = key(description="Length to compact to; less than trigger_chars.", ge=1)
    keep_last: int = key(description="Last turns never summarised; at least 1.", ge=1)


class CommandJudge(Section):
    """type = "command": a program scores each group, one JSON line per member."""

    type: Literal["command"] = key(description="command or ruler.")
    command: Argv = key(description="Judge program, as an argument list (no shell).")
    timeout_secs: float = key(30.0, "Deadline for one group.", gt=0)


class RulerJudge(Section):
    """type = "ruler": an OpenAI-compatible LLM grades the group against a rubric."""

    type: Literal["ruler"] = key(description="command or ruler.")
    base_url: Text = key(description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1.")
    model: Text = key(description="Model name sent with each request.")
    api_key_env: Text = key(
        "OPENAI_API_KEY", "Environment variable holding the API key (never the key itself)."
    )
    rubric: str | None = optional_key(
        "Grading criteria; a built-in rubric when left out. A prompt or scenario may set its own."
    )
    pairwise_rubric: str | None = optional_key(
        "Criteria of pairwise comparisons; built-in when left out."
    )
    temperature: float | None = optional_key(
        "Sampling temperature; the endpoint's default when left out. 0.0 is most repeatable.",
        ge=0,
    )
    max_concurrency: int = key(4, "Requests in flight at once.", ge=1)
    timeout_secs: float = key(120.0, "Timeout of one request.", gt=0)
    max_retries: int = key(2, "Retries on transient errors.", ge=0)
    cache_path: FilePath | None = optional_key("Verdict cache file; no cache when left out.")
    strategy: JudgeStrategy = key(JudgeStrategy(), "How answers are grouped into requests.")
    context: JudgeContext = key(JudgeContext(), "Character budgets of a request.")
    compaction: JudgeCompaction | None = optional_key(
        "Summarise the middle of long transcripts with the judge model."
    )


Judge = Annotated[CommandJudge | RulerJudge, Field(discriminator="type")]
