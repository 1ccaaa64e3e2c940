"""What a cross-key rule is made of: the Draft of the file it reads, the registry `@rule` adds it
to, and the Issues it yields (`issue`, `set_value`).

The rules live in rules_train.py, rules_algorithms.py, rules_agent.py and availability.py, and
import this module; rules.py runs them. Knows no rule itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from retrograd.config.report import MISSING, Issue


class Skip(Exception):  # noqa: N818 - not an error: a signal to the runner
    """A section a rule reads is broken: the rule has nothing sound to say."""


@dataclass
class Draft:
    """The file's sections after their own validation, before the rules between them."""

    raw: dict[str, Any]
    sections: dict[str, Any]
    failed: set[str] = field(default_factory=set)
    resume: bool = False
    supplied: frozenset[str] = frozenset()  # parts given as Python objects (load.SUPPLIED_PARTS)

    def get(self, name: str) -> Any:
        """The validated section, or None when the file leaves it out (defaults filled in)."""
        if name in self.failed:
            raise Skip(name)
        return self.sections.get(name)

    def need(self, name: str) -> Any:
        """The validated section; rules reading a section the file lacks are skipped (its
        absence is reported on its own)."""
        section = self.get(name)
        if section is None:
            raise Skip(name)
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
