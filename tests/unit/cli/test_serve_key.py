"""`retrograd serve`'s API key from the environment: a key on the command line is in every
process listing (`ps`, /proc/PID/cmdline), which every user of the machine reads."""

from __future__ import annotations

import pytest

from retrograd.cli import serve as serve_cli
from retrograd.cli.main import build_parser
from retrograd.errors import ConfigError
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.tiny_gguf import write_tiny


@pytest.fixture
def run_file(tmp_path):
    model = write_tiny(tmp_path / "tiny.gguf", "llama", chat_template=CHAT_TEMPLATE)
    path = tmp_path / "run.toml"
    path.write_text(
        f'[run]\nalgorithm = "sft"\n[model]\npath = "{model}"\n[output]\npath = "a.gguf"\n'
        '[lora]\n[sft]\ndata = "d.txt"\n'
    )
    (tmp_path / "d.txt").write_text("the cat sat on the mat\n")
    return path


def _served_key(monkeypatch, run_file, *flags) -> str | None:
    served = {}
    monkeypatch.setattr(
        serve_cli,
        "serve",
        lambda loaded, name, sock, key, *a: served.update(key=key) or sock.close(),
    )
    args = build_parser().parse_args(
        [
            "serve",
            str(run_file),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--base-only",
            "--device",
            "cpu",
            *flags,
        ]
    )
    assert serve_cli.run(args) is None
    return served["key"]


def test_the_key_comes_from_retrograd_api_key_when_no_flag_gives_it(monkeypatch, run_file):
    monkeypatch.setenv("RETROGRAD_API_KEY", "from-the-environment")
    assert _served_key(monkeypatch, run_file) == "from-the-environment"
    assert _served_key(monkeypatch, run_file, "--api-key", "flag") == "flag"  # the flag wins


def test_without_either_a_public_address_is_refused(monkeypatch, run_file):
    monkeypatch.delenv("RETROGRAD_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="requires --api-key or RETROGRAD_API_KEY"):
        _served_key(monkeypatch, run_file)
