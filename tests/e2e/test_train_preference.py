"""`retrograd train` for preference pairs, end to end on tiny models: each loss learns held-out
pairs, the shared prompt pass equals two rows, the reference's default passes give the whole
context's step, a killed run resumes exactly, and bad pairs are refused before the model
loads, naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.errors import DataError
from tests.e2e.test_train_grpo import _train, sinks
from tests.e2e.test_train_sft import CHAT_TEMPLATE, scalars
from tests.factories.run_files import write_run_file

# An obvious signal: the chosen answers are words of "e", the rejected ones words of "o".
E_WORDS = ["see", "tee", "bee", "eel", "feet", "seen", "free", "tree", "keen", "deep", "sheep"]
O_WORDS = ["moo", "too", "boo", "zoo", "food", "noon", "room", "pool", "loop", "hoop", "mood"]
PROMPTS = [
    "pick a word",
    "say one",
    "name a thing",
    "tell me more",
    "what comes next",
    "spell a word",
    "write some letters",
    "one more",
]
HELD_PROMPTS = ["give a word", "and now", "another one", "your turn"]


def pair(prompt: str, chosen: str, rejected: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def train_pairs() -> list[dict]:
    return [
        pair(q, f"{E_WORDS[i]} {E_WORDS[i + 1]}", f"{O_WORDS[i]} {O_WORDS[i + 1]}")
        for i, q in enumerate(PROMPTS)
    ]


def held_pairs() -> list[dict]:  # other prompts, other words, other combinations
    return [
        pair(q, f"{E_WORDS[-1 - i]} {E_WORDS[i]}", f"{O_WORDS[-1 - i]} {O_WORDS[i]}")
        for i, q in enumerate(HELD_PROMPTS)
    ]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("preference") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def write_run(tmp: Path, model: Path, preference: dict | None = None, **sections) -> Path:
    write_jsonl(tmp / "pairs.jsonl", train_pairs())
    write_jsonl(tmp / "held.jsonl", held_pairs())
    p = {"data": "pairs.jsonl", "loss": "dpo"}
    p.update(preference or {})
    t = {"lr": 1e-2, "ctx": 128, "micro_batch": 128, "epochs": 2}
    t.update(sections.pop("training", {}))  # None: leave the key out
    tables = {"training": t, "preference": p}
    return write_run_file(tmp, "preference", model, tables, sections)


def held_out_before(cfg) -> dict[str, float]:
    """The held-out statistics of the untrained model, as the run's evaluation computes them."""
    import retrograd
    from retrograd.algorithms import context
    from retrograd.algorithms.pairs import reference_scores, score_pairs
    from retrograd.algorithms.preference import NEEDS_REFERENCE, load_pairs, loss_of

    model = retrograd.load(cfg.model.path, device="cpu")
    _, held, _ = load_pairs(cfg, context.file_chat_format(cfg.model.path))
    ref = None
    if NEEDS_REFERENCE[cfg.preference.loss]:
        ref = reference_scores(cfg, model, {}, {"eval": held})["eval"]
    with torch.no_grad():
        stats = score_pairs(
            model.decoder,
            held,
            list(range(len(held))),
            cfg,
            ref,
            loss_of(cfg.preference),
            train=False,
        )
    return stats.values(eval_names=True)


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo"])
def test_each_loss_learns_held_out_pairs(chat_model, tmp_path, loss):
    from retrograd.algorithms.preference import run_preference

    run = write_run(
        tmp_path,
        chat_model,
        {"loss": loss, "pairs_per_step": 4},
        training={"epochs": 3},
        evaluation='data = "held.jsonl"',
        metrics='tensorboard_dir = "tb"',
    )
    cfg = load_run(run)
    before = held_out_before(cfg)
    result = run_preference(cfg, run_file=run, sinks=sinks())
    after = result.evals[-1][1]
    assert result.global_step == 6 and len(result.evals) == 3
    assert after["eval/preference_loss"] < before["eval/preference_loss"] - 0.05, (before, after)
    assert after["eval/accuracy"] == 1.0, (before, after)
    assert after["eval/margin"] > before["eval/margin"]
    assert (tmp_path / "out" / "adapter.gguf").exists()
    tb = tmp_path / "tb"
    assert sorted(scalars(tb, "preference/loss")) == list(range(1, 7))
    assert set(scalars(tb, "preference/pairs_per_step").values()) == {4.0}
    for tag in (
        "train/loss",
        "preference/accuracy",
        "preference/margin",
        "preference/chosen_reward",
        "preference/rejected_reward",
        "preference/chosen_logps",
        "preference/rejected_logps",
        "eval/preference_loss",
        "eval/accuracy",
        "eval/margin",
        "eval/chosen_logps",
        "eval/rejected_logps",
    ):
        assert scalars(tb, tag), tag
    orpo_only = ("preference/nll", "preference/log_odds", "preference/orpo_clamped")
    assert all(bool(scalars(tb, tag)) == (loss == "orpo") for tag in orpo_only)


def test_shared_prompt_pass_gives_the_loss_and_gradients_of_rows(chat_model, tmp_path):
    """Each pair scored after one pass over its prompt (fan-out auto, micro_batch large) and as
    two rows (off): the same loss and the same gradients, in float32."""
    import retrograd
    from retrograd.algorithms import context
    from retrograd.algorithms.pairs import Scores, pieces_of, score_pairs
    from retrograd.algorithms.preference import load_pairs, loss_of
    from retrograd.data.pairs import TokenPair
    from retrograd.trainable.lora import attach_lora

    run = write_run(tmp_path, chat_model, {"loss": "dpo"})
    cfg = load_run(run)
    pairs, _, _ = load_pairs(cfg, context.file_chat_format(chat_model))
    model = retrograd.load(chat_model, device="cpu", dtype=torch.float32)
    adapters = attach_lora(model.decoder, ["q", "v", "ffn_down"], rank=2, alpha=2.0, seed=0)
    with torch.no_grad():  # a nonzero B: gradients reach both factors
        for lora in adapters.values():
            for param in lora.parameters():
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(param.numel()))
    params = [p for lora in adapters.values() for p in lora.parameters()]
    members = [0, 3, 5]
    rng = np.random.default_rng(0)
    ref = Scores(
        rng.normal(-20, 2, len(pairs)).astype(np.float32),
        rng.normal(-20, 2, len(pairs)).astype(np.float32),
    )
    results = []
    for fanout in ("auto", "off"):
        training = cfg.training.model_copy(update={"shared_prefix_fanout": fanout})
        cfg = cfg.model_copy(update={"training": training})
        kinds = {p.shared for p in pieces_of(pairs, members, cfg.training.micro_batch, fanout)}
        assert kinds == {fanout == "auto"}
        stats = score_pairs(
            model.decoder, pairs, members, cfg, ref, loss_of(cfg.preference), train=True
        )
        results.append((stats, [p.grad.clone() for p in params]))
        for p in params:
            p.grad = None
    (shared, g_shared), (rows, g_rows) = results
    assert isinstance(pairs[0], TokenPair)
    assert shared.loss == pytest.approx(rows.loss, rel=1e-5)
    for k in ("chosen_logps", "rejected_logps", "margin"):
        np.testing.assert_allclose(shared.columns[k], rows.columns[k], rtol=1e-5, atol=1e-4)
    for a, b in zip(g_shared, g_rows, strict=True):  # equal up to float32 summation order
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()), (a - b).abs().max()
    assert sum(float(g.abs().sum()) for g in g_rows) > 0


def test_the_reference_default_passes_give_the_whole_context_step(chat_model, tmp_path):
    """ctx 128 with the reference's micro_batch (32, gradient_accumulation left out): the pairs
    do not fit a pass of 32, so each goes as its own pass of two rows; the steps equal those
    of micro_batch = ctx, where each pair shares its prompt pass."""
    from gguf import GGUFReader

    from retrograd.algorithms.preference import run_preference

    adapters, losses = [], []
    for name, micro in (("default", None), ("whole", 128)):
        tmp = tmp_path / name
        tmp.mkdir()
        training = {"ctx": 128, "micro_batch": micro, "gradient_accumulation": None, "lr": 1e-3}
        run = write_run(
            tmp,
            chat_model,
            {"loss": "dpo"},
            training={**training, "epochs": 1},
            metrics='tensorboard_dir = "tb"',
        )
        cfg = load_run(run)
        assert cfg.training.micro_batch == (micro or 32)
        result = run_preference(cfg, run_file=run, sinks=sinks())
        assert result.global_step == 5  # 8 pairs of 55 to 68 tokens, 1 or 2 to a window of 128
        reader = GGUFReader(tmp / "out" / "adapter.gguf")
        adapters.append({t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors})
        losses.append(scalars(tmp / "tb", "preference/loss"))
    default, whole = adapters
    assert losses[0].keys() == losses[1].keys() == {1, 2, 3, 4, 5}
    for step in (1, 2, 3, 4, 5):
        assert losses[0][step] == pytest.approx(losses[1][step], rel=1e-3, abs=1e-4)
    moved = sum(float(np.abs(v).sum()) for k, v in whole.items() if k.endswith(".lora_b"))
    assert moved > 0
    diff = sum(float(np.abs(default[k] - whole[k]).sum()) for k in whole)
    assert diff < 1e-2 * moved, (diff, moved)


def test_the_three_references_of_an_untrained_adapter_are_one(chat_model, tmp_path):
    """Without an initial adapter the initial policy, the base with the adapter off and a
    [reference] section naming the same file score alike: the runs end byte-identical."""
    outputs = []
    for name, pref, extra in (
        ("initial", {}, {}),
        ("base", {"reference": "base"}, {}),
        ("model", {}, {"reference": f'model = "{chat_model}"'}),
    ):
        tmp = tmp_path / name
        tmp.mkdir()
        run = write_run(tmp, chat_model, {"loss": "ipo", "pairs_per_step": 4, **pref}, **extra)
        assert main(["train", str(run)]) == 0
        outputs.append((tmp / "out" / "adapter.gguf").read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]


def test_cli_trains_and_writes_its_checkpoints(chat_model, tmp_path, capsys):
    run = write_run(
        tmp_path,
        chat_model,
        {"loss": "simpo", "pairs_per_step": 2},
        checkpoint='directory = "ck"\nmode = "steps"\nevery_steps = 2',
    )
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    assert "8 pairs" in out
    states = sorted(p.name for p in (tmp_path / "ck").glob("step-*.state"))
    assert states[-1] == "step-000000000008.state"


@pytest.mark.slow
def test_resume_after_kill_is_byte_identical(chat_model, tmp_path):
    """dpo against the initial policy (its scores kept in the checkpoint), shuffled pairs: a
    run killed after its checkpoint at step 2 and resumed ends with the uninterrupted run's
    adapter, byte for byte."""
    sections = {"checkpoint": 'directory = "ck"\nmode = "steps"\nevery_steps = 2'}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_run(
            d, chat_model, {"loss": "dpo", "pairs_per_step": 2}, training={"epochs": 6}, **sections
        )
    done = _train(whole / "run.toml")
    assert done.returncode == 0, done.stderr
    _train(cut / "run.toml", wait_for=cut / "ck" / "step-000000000002.state")
    assert not (cut / "out" / "adapter.gguf").exists()
    resumed = _train(cut / "run.toml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (whole / "out" / "adapter.gguf").read_bytes() == (
        cut / "out" / "adapter.gguf"
    ).read_bytes()


# -- bad input, refused before the model loads ---------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: refusals must come first."""

    def refuse(cfg):
        raise AssertionError("the model loaded before the pairs were checked")

    monkeypatch.setattr("retrograd.algorithms.context.load_model", refuse)


def _refused(run: Path) -> str:
    from retrograd.algorithms.preference import run_preference

    with pytest.raises(DataError) as caught:
        run_preference(load_run(run), run_file=run)
    return str(caught.value)


def test_a_broken_pair_line_is_refused_naming_it(chat_model, tmp_path, no_model):
    run = write_run(tmp_path, chat_model)
    records = train_pairs()
    del records[1]["chosen"]
    write_jsonl(tmp_path / "pairs.jsonl", records)
    assert _refused(run) == 'pairs.jsonl:2: missing "chosen"'


def test_a_template_that_rewrites_the_prompt_is_refused(tmp_path, no_model):
    """This template marks the last message: the prompt alone renders differently from the
    prompt followed by an answer."""
    from tests.factories.tiny_gguf import write_tiny

    template = CHAT_TEMPLATE.replace(
        "{{ m['role'] }}: ", "{{ m['role'] }}{% if loop.last %}*{% endif %}: "
    )
    model = write_tiny(tmp_path / "rewrites.gguf", "gemma3", chat_template=template)
    run = write_run(tmp_path, model)
    message = _refused(run)
    assert message.startswith("pairs.jsonl:1: the chat template renders the prompt differently")


def test_an_over_length_pair_is_refused_naming_its_line(chat_model, tmp_path, no_model):
    run = write_run(tmp_path, chat_model)  # ctx 128
    records = train_pairs()
    records[2]["rejected"][0]["content"] = "loop " * 20
    write_jsonl(tmp_path / "pairs.jsonl", records)
    message = _refused(run)
    assert message.startswith("pairs.jsonl:3: the pair renders to ")
    assert "[training].ctx = 128" in message


def test_an_over_length_held_out_pair_is_refused_too(chat_model, tmp_path, no_model):
    run = write_run(tmp_path, chat_model, evaluation='data = "held.jsonl"')
    records = held_pairs()
    records[3]["chosen"][0]["content"] = "see " * 30
    write_jsonl(tmp_path / "held.jsonl", records)
    assert _refused(run).startswith("held.jsonl:4: the pair renders to ")


def test_a_fanout_every_pair_cannot_meet_is_refused(chat_model, tmp_path, no_model):
    run = write_run(
        tmp_path, chat_model, training={"micro_batch": 16, "shared_prefix_fanout": "max"}
    )
    message = _refused(run)
    assert message.startswith("pairs.jsonl:1: its shared-prompt pass takes ")


def test_a_multi_turn_answer_scores_only_what_the_model_writes(chat_model, tmp_path):
    """A chosen answer that calls a tool, reads its result and answers: the call and the final
    answer are scored, the tool's result is context; the prompt's ids come first, once."""
    from retrograd.algorithms import context
    from retrograd.data.pairs import read_pairs, tokenize_pairs

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    record = pair("add 2 and 3", "", "six")
    record["tools"] = tools
    record["chosen"] = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "five"},
    ]
    write_jsonl(tmp_path / "pairs.jsonl", [record])
    chat = context.file_chat_format(chat_model)
    (tp,) = tokenize_pairs(read_pairs(tmp_path / "pairs.jsonl"), chat, 1024)
    full = chat.encode(
        [*record["prompt"], *record["chosen"]], tools
    )  # the whole conversation, as SFT would train it
    n = len(tp.prompt)
    assert list(full.ids[:n]) == list(tp.prompt) and not any(full.train_mask[:n])
    assert list(tp.chosen) == list(full.ids[n : n + len(tp.chosen)])
    assert list(tp.chosen_mask) == list(full.train_mask[n : n + len(tp.chosen)])
    assert 0 in tp.chosen_mask and tp.chosen_mask[-1] == 1  # the result is context
    text = chat.tokenizer.detokenize(
        [t for t, m in zip(tp.chosen, tp.chosen_mask, strict=True) if m]
    )
    assert "five" in text and "add" in text and "5" not in text.replace("five", "")


def test_assistant_turns_inside_the_prompt_are_context(chat_model, tmp_path):
    """Few-shot turns in the prompt (an assistant answer before the question) are neither a
    template mismatch nor scored: the answer alone is."""
    from retrograd.algorithms import context
    from retrograd.data.pairs import read_pairs, tokenize_pairs

    record = pair("spell cat", "CAT", "cat")
    record["prompt"] = [
        {"role": "user", "content": "spell dog"},
        {"role": "assistant", "content": "DOG"},
        *record["prompt"],
    ]
    write_jsonl(tmp_path / "pairs.jsonl", [record])
    chat = context.file_chat_format(chat_model)
    (tp,) = tokenize_pairs(read_pairs(tmp_path / "pairs.jsonl"), chat, 1024)
    full = chat.encode([*record["prompt"], *record["chosen"]], None)
    n = len(tp.prompt)
    assert list(full.ids[:n]) == list(tp.prompt)
    assert any(full.train_mask[:n])  # SFT would train the example answer; a pair does not
    assert list(tp.chosen) == list(full.ids[n : n + len(tp.chosen)])
    assert tp.chosen_mask[-1] == 1  # the end of the turn the model writes
    written = [t for t, m in zip(tp.chosen, tp.chosen_mask, strict=True) if m]
    assert "CAT" in chat.tokenizer.detokenize(written)
    assert "DOG" not in chat.tokenizer.detokenize(list(tp.chosen))
