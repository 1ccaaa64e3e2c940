"""examples/agent/ (docs/agent.md): the run files load, the scenario files parse and are
graded by the run's environment, the committed data is what make_warmstart.py writes, and its
warm-start records are read by the SFT reader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import retrograd
from retrograd.agent.scenarios import read_scenarios
from retrograd.agent.tools.catalog import load_catalog
from retrograd.config import load_run
from retrograd.data.sft import load_sft_data
from retrograd.gguf import GGUFFile
from retrograd.tokenizer.conversation import ChatFormat
from retrograd.tokenizer.fallbacks import chat_template

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agent"


@pytest.fixture(scope="module")
def make():
    spec = importlib.util.spec_from_file_location("make_warmstart", EXAMPLE / "make_warmstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_files_load():
    sft = load_run(EXAMPLE / "warmstart.toml", model="model.gguf")
    agent = load_run(EXAMPLE / "files.toml", model="model.gguf")
    assert sft.run.algorithm == "sft" and agent.run.algorithm == "agent_grpo"
    # the GRPO run starts from the adapter the warm start writes
    assert agent.lora.init_adapter == sft.output.path
    assert agent.agent.scenarios.is_file() and agent.evaluation.data.is_file()


def test_scenarios_parse_and_are_verifiable():
    cfg = load_run(EXAMPLE / "files.toml", model="model.gguf")
    train = read_scenarios(cfg.agent.scenarios)
    held = read_scenarios(cfg.evaluation.data, "[evaluation].data")
    assert len(train) >= 32 and len(held) >= 16
    assert not {s.id for s in train.scenarios} & {s.id for s in held.scenarios}
    for s in (*train.scenarios, *held.scenarios):
        assert s.env is not None and s.env.verify is not None
        assert s.env.verify.command[:2] == ("grep", "-qx")


def test_committed_data_is_what_the_script_writes(make, tmp_path):
    import json

    train, held = make.scenario_files()
    for rows, name in ((train, "files.jsonl"), (held, "files-eval.jsonl")):
        lines = (EXAMPLE / name).read_text(encoding="utf-8").splitlines()
        assert [json.loads(x) for x in lines] == rows
    make.main(["--out", str(tmp_path / "w.jsonl")])
    assert [json.loads(x) for x in (tmp_path / "w.jsonl").read_text().splitlines()] == (
        make.warmstart_records()
    )
    # warm-start words are not the scenarios' words
    words = {r["metadata"]["word"] for r in make.warmstart_records()}
    assert not words & set(make.WORDS)


def test_warmstart_catalog_is_the_toolset_the_run_offers(make):
    cfg = load_run(EXAMPLE / "files.toml", model="model.gguf")
    tools = cfg.agent.environment.tools
    catalog = load_catalog(tools, EXAMPLE)
    offered = [s.openai() for s in catalog.specs()]
    assert offered == make.TOOLS


def test_warmstart_records_pass_the_sft_reader(make, tmp_path):
    from tests.factories.agents import CHAT_TEMPLATE
    from tests.factories.tiny_gguf import write_tiny

    path = write_tiny(tmp_path / "tiny.gguf", "gemma3", seed=0, chat_template=CHAT_TEMPLATE)
    tok = retrograd.load_tokenizer(path)
    chat = ChatFormat(tok, chat_template(tok, GGUFFile(path).metadata))
    out = tmp_path / "warmstart.jsonl"
    make.main(["--out", str(out)])
    data = load_sft_data(out, tok, 4096, chat=chat)
    assert len(data.examples) == len(make.WARM_WORDS) and data.truncated == 0
