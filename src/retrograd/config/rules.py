"""The rule runner: every cross-key rule sees a Draft of the file and yields Issues.

A rule reads sections through `Draft.get`; when a section it needs failed its own validation,
the rule is skipped (its verdict would be noise), so one broken key does not hide the other
rules' findings. Rules are plain generator functions registered with `@rule`; the rules
themselves live in rules_train.py, rules_algorithms.py and rules_agent.py, and the refusal of
what this version cannot honour in availability.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from retrograd.config.report import MISSING, Issue


class _Skip(Exception):
    """A section a rule reads is broken: the rule has nothing sound to say."""


@dataclass
class Draft:
    """The file's sections after their own validation, before the rules between them."""

    raw: dict[str, Any]
    sections: dict[str, Any]
    failed: set[str] = field(default_factory=set)
    resume: bool = False

    def get(self, name: str) -> Any:
        """The validated section, or None when the file leaves it out (defaults filled in)."""
        if name in self.failed:
            raise _Skip(name)
        return self.sections.get(name)

    def need(self, name: str) -> Any:
        """The validated section; rules reading a section the file lacks are skipped (its
        absence is reported on its own)."""
        section = self.get(name)
        if section is None:
            raise _Skip(name)
        return section

    def present(self, name: str) -> bool:
        """True when the file writes the section itself."""
        return name in self.raw

    @property
    def algorithm(self) -> str:
        return self.need("run").algorithm

    @property
    def mode(self) -> str:
        """training.trainable: lora, full, partial or hybrid."""
        return self.get("training").trainable


Rule = Callable[[Draft], Iterator[Issue]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def issue(table: str, key: str | None, message: str, value: Any = MISSING) -> Issue:
    """An Issue at a dotted table name (`"grpo.judge"`)."""
    parts = tuple(int(p) if p.isdigit() else p for p in table.split(".")) if table else ()
    return Issue(parts, key, message, value)


def set_value(section: Any, name: str) -> Any:
    """The value of a key the file wrote (for the message), else MISSING."""
    return getattr(section, name) if section is not None and section.is_set(name) else MISSING


def run_rules(draft: Draft) -> list[Issue]:
    # Imported for their @rule registrations.
    from retrograd.config import (  # noqa: F401
        availability,
        rules_agent,
        rules_algorithms,
        rules_train,
    )

    found: list[Issue] = []
    for check in RULES:
        try:
            found.extend(check(draft))
        except _Skip:
            continue
    return found
