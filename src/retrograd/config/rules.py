"""The rule runner: every cross-key rule sees a Draft of the file and yields Issues.

A rule reads sections through `Draft.get`; when a section it needs failed its own validation,
the rule is skipped (its verdict would be noise), so one broken key does not hide the other
rules' findings. Rules are plain generator functions registered with `@rule` (rule_base.py);
the rules themselves live in rules_train.py, rules_algorithms.py and rules_agent.py, and the
refusal of what this version cannot honour in availability.py.
"""

from __future__ import annotations

from retrograd.config.report import Issue
from retrograd.config.rule_base import RULES, Draft, Skip


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
        except Skip:
            continue
    return found
