"""problem+json documents: codes, pointers, hints within edit distance 2, redaction."""

from __future__ import annotations

import pytest

from retrograd.config import RunConfig, validate_run
from retrograd.errors import ConfigError
from retrograd.server.problems import (
    FieldError,
    Problem,
    closest,
    edit_distance,
    issues_to_errors,
    redact_paths,
)


def test_edit_distance_and_closest_within_two():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("lr", "lr") == 0
    assert closest("lrr", ["lr", "epochs"]) == "lr"
    assert closest("trainig", ["training", "run"]) == "training"
    assert closest("completely_else", ["lr", "epochs"]) is None


def test_loader_issues_become_pointers_and_codes(tmp_path):
    document = {
        "run": {"algorithm": "sft"},
        "output": {"path": "a.gguf"},
        "lora": {"rank": 0, "alhpa": 2.0},
        "training": {"lr": "fast"},
        "sft": {},
    }
    with pytest.raises(ConfigError) as caught:
        validate_run(document, base_dir=tmp_path)
    errors = {e.pointer: e for e in issues_to_errors(caught.value.issues, RunConfig, ("config",))}
    assert errors["/config/lora/alhpa"].code == "unknown_field"
    assert errors["/config/lora/alhpa"].hint == "alpha"
    assert errors["/config/lora/rank"].code == "out_of_range"
    assert errors["/config/training/lr"].code == "invalid_value"
    assert errors["/config/sft/data"].code == "missing_field"


def test_documents_and_redaction():
    p = Problem(
        "forbidden-path", "no", [FieldError("/a", "forbidden_path", "/etc/passwd: outside")]
    )
    doc = p.document("t1", redact=True)
    assert doc["type"] == "https://retrograd.dev/problems/forbidden-path" and doc["status"] == 403
    assert doc["errors"][0]["message"] == "<path>: outside" and doc["trace_id"] == "t1"
    assert (
        Problem("timeout", "slow", [FieldError("/a", "conflict", "x")]).document("t")["errors"]
        == []
    )
    assert (
        redact_paths("see /tmp/x/run.json, or application/json")
        == "see <path>, or application/json"
    )
