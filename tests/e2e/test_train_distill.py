"""`retrograd train` for distillation, end to end on tiny models. The teacher is the student
with an adapter merged in (examples/distill/make_teacher.py), the adapter trained by SFT to
answer with words of "e": a teacher that differs from the student the way a fine-tuned model
does. On-policy and offline distillation lower the KL to it; a killed run resumes exactly;
`distill-teacher` writes a sidecar that a run refuses once the corpus or ctx changes; `bench`
reports KL, top-1 agreement and perplexity for the base model and the adapter."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest

import retrograd
from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.errors import ConfigError, DataError
from tests.e2e.test_bench import table_rows
from tests.e2e.test_train_grpo import _train, sinks
from tests.e2e.test_train_preference import no_model  # noqa: F401  (a fixture)
from tests.e2e.test_train_sft import CHAT_TEMPLATE
from tests.factories.run_files import write_run_file

ROOT = Path(__file__).resolve().parents[2]
E_WORDS = ["see", "tee", "bee", "eel", "feet", "seen", "free", "tree", "keen", "deep", "sheep"]
PROMPTS = [
    "write some letters",
    "say something",
    "spell a word",
    "what comes next",
    "name a thing",
    "tell me more",
]
# twelve held-out prompts: the evaluation samples one answer each, and fewer made its KL noisy
# enough (one 3-prompt estimate ranged 1.5-2.7 over seeds) to hide the fall
HELD = [
    "give a word",
    "and now",
    "your turn",
    "one more",
    "keep going",
    "try again",
    "another one",
    "go on",
    "what else",
    "say it",
    "next word",
    "continue",
]


def corpus(prompts: list[str], shift: int = 0) -> str:
    rows = [
        {
            "messages": [
                {"role": "user", "content": p},
                {
                    "role": "assistant",
                    "content": " ".join(E_WORDS[i + shift + j] for j in (0, 2, 4)),
                },
            ]
        }
        for i, p in enumerate(prompts)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def prompt_file(prompts: list[str]) -> str:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(student, teacher): a tiny gemma3, and itself with an SFT adapter on "e" words merged."""
    from retrograd.algorithms.sft import run_sft
    from tests.factories.tiny_gguf import write_tiny

    root = tmp_path_factory.mktemp("distill")
    student = write_tiny(root / "student.gguf", "gemma3", chat_template=CHAT_TEMPLATE)
    (root / "ewords.jsonl").write_text(corpus(PROMPTS))
    (root / "sft.toml").write_text("""
[run]
algorithm = "sft"
[model]
path = "student.gguf"
device = "cpu"
[output]
path = "e-adapter.gguf"
[lora]
rank = 4
alpha = 8.0
targets = ["q", "v", "ffn_down"]
[training]
lr = 2e-2
epochs = 4
ctx = 64
micro_batch = 64
[sft]
data = "ewords.jsonl"
""")
    run_sft(load_run(root / "sft.toml"), run_file=root / "sft.toml")
    merge = runpy.run_path(str(ROOT / "examples" / "distill" / "make_teacher.py"))["merge"]
    teacher = root / "teacher.gguf"
    assert merge(student, root / "e-adapter.gguf", teacher) == 3 * 3  # 3 targets x 3 layers
    return student, teacher


def write_run(tmp: Path, models, distill: dict | None = None, **sections) -> Path:
    student, teacher = models
    (tmp / "prompts.jsonl").write_text(prompt_file(PROMPTS))
    (tmp / "held.jsonl").write_text(prompt_file(HELD))
    (tmp / "corpus.jsonl").write_text(corpus(PROMPTS))
    d = {"teacher_path": str(teacher)}
    d.update(
        distill
        or {
            "prompts": "prompts.jsonl",
            "updates": 8,
            "prompts_per_update": 4,
            "samples_per_prompt": 4,
        }
    )
    t = {"lr": 2e-2, "ctx": 64, "micro_batch": 64}
    t.update(sections.pop("training", {}))  # None: leave the key out
    tables = {"training": t, "distill": d}
    if d.get("mode") != "topk_offline":
        sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12, "seed": 3}
        tables["distill.sampling"] = sampling
    return write_run_file(tmp, "distill", student, tables, sections)


def agreement(cfg, data: Path, adapter: Path | None = None):
    from retrograd.algorithms import context
    from retrograd.algorithms.evaluate import teacher_agreement
    from retrograd.data.sft import load_sft_data
    from retrograd.trainable.lora import apply_adapter_file

    student = retrograd.load(cfg.model.path, device="cpu")
    teacher = retrograd.load(cfg.distill.teacher_path, device="cpu")
    if adapter is not None:
        apply_adapter_file(student.decoder, adapter)
    chat = context.file_chat_format(cfg.model.path)
    ds = load_sft_data(data, chat.tokenizer, cfg.training.ctx, "jsonl", chat)
    return teacher_agreement(student.decoder, teacher.decoder, ds)


# -- on-policy --------------------------------------------------------------------------------


def test_on_policy_lowers_the_teacher_kl_on_held_out_prompts(models, tmp_path):
    from retrograd.algorithms.distill import held_out_kl, run_distill
    from retrograd.data.prompts import read_prompts, render_prompts
    from retrograd.rollout.sample import held_out
    from retrograd.sampling import Sampler

    run = write_run(
        tmp_path,
        models,
        evaluation='data = "held.jsonl"\nevery_iterations = 4',
        metrics='tensorboard_dir = "tb"',
    )
    cfg = load_run(run)
    # the untrained student's held-out KL, measured as the run's evaluation measures it
    student = retrograd.load(cfg.model.path, device="cpu")
    teacher = retrograd.load(cfg.distill.teacher_path, device="cpu")
    from retrograd.algorithms import context

    held = render_prompts(
        read_prompts(tmp_path / "held.jsonl", "held"), context.chat_format(student), 64
    )
    sampler = Sampler(student.decoder, student.tokenizer, fast=True, max_len=64)
    before, _ = held_out_kl(cfg, sampler, student, teacher, held_out(held, None))
    result = run_distill(cfg, run_file=run, sinks=sinks())
    assert result.iterations == 8 and result.global_step == 8
    last_update, evaluated = result.evals[-1]
    after = evaluated["eval/teacher_kl"]
    assert last_update == 8
    assert before > 1.0, before  # the teacher is far: its "e" words are unlikely to the student
    # measured over seeds 1-5: after / before 0.65-0.79 at update 8
    assert after < 0.85 * before, (before, result.evals)
    # the training metric falls with it: the last updates' mean KL below the first's
    assert sum(result.curve[-3:]) < sum(result.curve[:3])
    tags = _tensorboard_tags(tmp_path / "tb")
    for name in (
        "distill/teacher_kl_mean",
        "distill/teacher_kl_p95",
        "distill/advantage_clipped_fraction",
        "completions/truncation_fraction",
        "policy/sampler_logprob_gap",  # docs/distill.md, "Metrics"
        "eval/teacher_kl",
    ):
        assert name in tags, name


def _tensorboard_tags(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


@pytest.mark.slow
def test_on_policy_resume_after_kill_is_byte_identical(models, tmp_path):
    """Two optimizer passes an update (clipping on), a KL term toward the base, shuffled
    prompts: a run killed after its checkpoint at step 4 and resumed ends with the
    uninterrupted run's adapter."""
    distill = {
        "prompts": "prompts.jsonl",
        "updates": 4,
        "prompts_per_update": 2,
        "samples_per_prompt": 2,
        "distill_epochs": 2,
        "kl_coefficient": 0.05,
        "prompt_order": "shuffled",
    }
    checkpoint = 'directory = "ck"\nmode = "steps"\nevery_steps = 4'
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_run(d, models, dict(distill), checkpoint=checkpoint)
    done = _train(whole / "run.toml")
    assert done.returncode == 0, done.stderr
    _train(cut / "run.toml", wait_for=cut / "ck" / "step-000000000004.state")
    assert not (cut / "out" / "adapter.gguf").exists()
    resumed = _train(cut / "run.toml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (whole / "out" / "adapter.gguf").read_bytes() == (
        cut / "out" / "adapter.gguf"
    ).read_bytes()


def test_mask_truncated_leaves_cut_answers_out(models, tmp_path):
    """The tiny student never stops within 12 tokens: with mask_truncated every answer is
    cut, nothing trains, and the adapter stays at its initial value (B = 0)."""
    from retrograd.algorithms.distill import run_distill

    distill = {"prompts": "prompts.jsonl", "updates": 2, "prompts_per_update": 2}
    run = write_run(tmp_path, models, dict(distill, mask_truncated=True))
    result = run_distill(load_run(run), run_file=run, sinks=sinks())
    assert result.iterations == 2 and result.global_step == 0 and result.curve == []
    # and at the reference's ctx 128 and micro_batch 32: a pass holds one answer (prompt and
    # answer are longer than 32 tokens), the update still one optimizer step
    run = write_run(
        tmp_path,
        models,
        dict(distill, mask_truncated=False),
        training={"ctx": None, "micro_batch": None},
    )
    result = run_distill(load_run(run), run_file=run, sinks=sinks())
    assert result.global_step == 2 and len(result.curve) == 2


def test_a_teacher_with_another_vocabulary_is_refused(models, tmp_path):
    from retrograd.algorithms.distill import run_distill
    from tests.factories.tiny_gguf import write_tiny

    other = tmp_path / "other.gguf"
    write_tiny(other, "gemma3", chat_template=CHAT_TEMPLATE)
    from gguf import GGUFReader

    # same shapes, one token spelled differently: ids would mean other words
    r = GGUFReader(other, "r+")
    field = r.fields["tokenizer.ggml.tokens"]
    part = field.parts[field.data[-1]]
    part[0] = ord("#") if part[0] != ord("#") else ord("%")
    r.data.flush()
    run = write_run(tmp_path, (models[0], other))
    with pytest.raises(ConfigError, match=r"teacher_path .* tokenizer differs"):
        run_distill(load_run(run), run_file=run)


# -- offline top-k ----------------------------------------------------------------------------


OFFLINE = {"mode": "topk_offline", "data": "corpus.jsonl", "sidecar": "corpus.topk"}


def test_offline_distillation_lowers_the_kl_and_bench_reports_it(models, tmp_path, capsys):
    # the reference's defaults (ctx 128, micro_batch 32): an example runs in passes of 32
    # tokens, the later ones reading the earlier ones' cache, as SFT's do
    run = write_run(
        tmp_path,
        models,
        dict(OFFLINE, offline_epochs=3),
        training={"ctx": None, "micro_batch": None},
    )
    # the teacher alone writes the sidecar (its path from the run file)
    assert main(["distill-teacher", str(run), "--k", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the line
    assert re.search(r"wrote .*corpus.topk: \d+ positions of 6 examples, k = 8", out), out
    assert main(["train", str(run)]) == 0
    cfg = load_run(run)
    before = agreement(cfg, tmp_path / "corpus.jsonl")
    after = agreement(cfg, tmp_path / "corpus.jsonl", tmp_path / "out" / "adapter.gguf")
    assert before.kl > 1.0, before
    assert after.kl < 0.5 * before.kl, (before, after)
    assert after.top1 > before.top1
    capsys.readouterr()
    assert main(["bench", str(run), "--adapter", str(tmp_path / "out" / "adapter.gguf")]) == 0
    out = capsys.readouterr().out
    assert "distill bench" in out
    rows = {row[0]: row for row in table_rows(out)}
    assert list(rows) == ["base", "adapter.gguf", "teacher"]
    for label, want in (("base", before), ("adapter.gguf", after)):
        _, kl, reverse, top1, ppl, tokens, _ = rows[label]
        assert float(kl) == pytest.approx(want.kl, abs=1e-4)
        assert float(reverse) == pytest.approx(want.reverse_kl, abs=1e-4)
        assert float(top1.rstrip("%")) == pytest.approx(100 * want.top1, abs=0.05)
        assert int(tokens) == want.tokens == 108
    assert float(rows["teacher"][1]) == pytest.approx(0.0, abs=1e-4)


@pytest.mark.usefixtures("no_model")
def test_a_sidecar_of_another_corpus_or_ctx_is_refused_before_the_model_loads(models, tmp_path):
    from retrograd.algorithms.distill import run_distill

    run = write_run(tmp_path, models, dict(OFFLINE))
    assert main(["distill-teacher", str(run)]) == 0
    (tmp_path / "corpus.jsonl").write_text(corpus(PROMPTS, shift=1))
    with pytest.raises(DataError, match=r"corpus.topk: written for corpus.jsonl \(sha256"):
        run_distill(load_run(run), run_file=run)
    (tmp_path / "corpus.jsonl").write_text(corpus(PROMPTS))
    run = write_run(tmp_path, models, dict(OFFLINE), training={"ctx": 32, "micro_batch": 32})
    with pytest.raises(DataError, match=r"written at ctx 64, the run has \[training\].ctx = 32"):
        run_distill(load_run(run), run_file=run)


def test_an_offline_run_refuses_evaluation_and_a_missing_sidecar_says_how_to_write_it(
    models, tmp_path
):
    from retrograd.algorithms.distill import run_distill

    run = write_run(tmp_path, models, dict(OFFLINE), evaluation='data = "corpus.jsonl"')
    (tmp_path / "corpus.topk").write_bytes(b"not a sidecar")
    with pytest.raises(ConfigError, match=r"\[evaluation\]: offline distillation runs no"):
        run_distill(load_run(run), run_file=run)
    run = write_run(tmp_path, models, dict(OFFLINE))
    with pytest.raises(DataError, match=r"not a .topk sidecar \(write one with `retrograd"):
        run_distill(load_run(run), run_file=run)
