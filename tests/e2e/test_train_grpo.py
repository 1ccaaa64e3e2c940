"""`retrograd train` for GRPO, end to end on tiny models: it learns, resumes exactly after a
real kill, and refuses bad input before the model loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from retrograd.cli.main import main
from retrograd.config import load_run
from retrograd.errors import DataError
from tests.e2e.test_train_sft import CHAT_TEMPLATE, scalar_events, scalars
from tests.factories.run_files import write_run_file

# A reward with an obvious signal for a tiny random model: the share of "e" in the answer.
REWARD = r"""
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req:
        print(json.dumps(req), flush=True)
        continue
    if "_retrograd_batch_end" in req:
        print(json.dumps(req, separators=(",", ":")), flush=True)
        continue
    text = req["completion"]
    reward = text.count("e") / max(1, len(text))
    print(json.dumps({"reward": reward, "_retrograd_batch": req["_retrograd_batch"],
                      "_retrograd_index": req["_retrograd_index"]}), flush=True)
"""

PROMPTS = [
    "write some letters",
    "say something",
    "spell a word",
    "what comes next",
    "name a thing",
    "tell me more",
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny gemma3 with a chat template (the tiny vocabulary has no family's markers)."""
    from tests.factories.tiny_gguf import write_tiny

    path = tmp_path_factory.mktemp("grpo") / "tiny-chat.gguf"
    return write_tiny(path, "gemma3", chat_template=CHAT_TEMPLATE)


def write_run(tmp: Path, model: Path, grpo: dict | None = None, **sections) -> Path:
    (tmp / "reward.py").write_text(REWARD)
    lines = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    g = {
        "prompts": "prompts.jsonl",
        # the working directory, not the run file's, resolves a relative script: give its path
        "reward_command": [sys.executable, str(tmp / "reward.py")],
        "updates": 8,
        "prompts_per_update": 2,
        "group_size": 8,
        "grpo_epochs": 1,
        "clip_range_low": 0.2,
        "clip_range_high": 0.28,
        "kl_coefficient": 0.0,
    }
    g.update(grpo or {})
    t = {"lr": 2e-2, "ctx": 64, "micro_batch": 64, "gradient_accumulation": 1}
    t.update(sections.pop("training", {}))  # None: leave the key out
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 3}
    sampling.update(sections.pop("sampling", {}))
    tables = {"training": t, "grpo": g, "grpo.sampling": sampling}
    return write_run_file(tmp, "grpo", model, tables, sections)


def sinks():
    """The metric sinks `retrograd train` opens (TensorBoard with [metrics]), printing nowhere."""
    import io

    from rich.console import Console

    from retrograd.observe.sinks import Sinks

    return Sinks(console=Console(file=io.StringIO()))


def test_reward_rises_on_a_task_with_an_obvious_signal(chat_model, tmp_path):
    from retrograd.algorithms.grpo import run_grpo

    run = write_run(
        tmp_path,
        chat_model,
        {"updates": 12},
        metrics='tensorboard_dir = "tb"',
    )
    cfg = load_run(run)
    result = run_grpo(cfg, run_file=run, sinks=sinks())
    rewards = result.curve
    assert len(rewards) == 12
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.1, rewards
    assert (tmp_path / "out" / "adapter.gguf").exists()
    tb = tmp_path / "tb"
    # one record per update at its global step (formats.md: step = global_step): an update
    # whose every group scored alike makes no optimizer step, so it shares the previous step
    steps = [e.step for e in scalar_events(tb, "reward/mean")]
    assert len(steps) == 12 and steps == sorted(steps), steps
    assert steps[-1] == result.global_step and len(set(steps)) >= 6, steps
    for tag in (
        "policy/surrogate_loss",
        "policy/clip_fraction",
        "completions/length_mean",
        "batch/trained_fraction",
        "timing/reward_seconds",
    ):
        assert scalars(tb, tag), tag


def test_a_python_reward_function_is_learned(chat_model, tmp_path):
    """The share of "e" as a Python reward function (the run's program answers 0 to every
    answer): the function's rewards reach the run and it learns them as it learns a program's."""
    from retrograd.algorithms.door import Door
    from retrograd.algorithms.grpo import run_grpo

    (tmp_path / "zero.py").write_text(REWARD.replace('text.count("e")', "0"))
    zero = [sys.executable, str(tmp_path / "zero.py")]
    run = write_run(tmp_path, chat_model, {"updates": 12, "reward_command": zero})

    def share_of_e(prompts, completions, **columns):
        return [c.count("e") / max(1, len(c)) for c in completions]

    result = run_grpo(load_run(run), Door(sinks(), rewards=(share_of_e,), run_file=run))
    first, last = np.mean(result.curve[:3]), np.mean(result.curve[-3:])
    assert last > first + 0.1, result.curve


def test_bf16_learns_as_float32_does(chat_model, tmp_path, monkeypatch):
    """The same short runs in both compute dtypes (RETRO_DTYPE), over three sampling seeds:
    bf16 samples other answers (16-bit logits and cache), so the curves differ, but it learns as
    float32 does: over the seeds each dtype climbs, bf16 by at least half of float32's climb, no
    run ends below where it began, and the sampler's log-probabilities stay near the trainer's
    float32 ones. One seed alone is a coin: a run's climb depends on the answers it happens to
    draw, and those change with the thread count's rounding."""
    from retrograd.algorithms.grpo import run_grpo

    climbs, gaps = {}, {}
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setenv("RETRO_DTYPE", dtype)
        for seed in (3, 5, 7):
            tmp = tmp_path / f"{dtype}-{seed}"
            tmp.mkdir()
            run = write_run(
                tmp, chat_model, {"updates": 12}, metrics='tensorboard_dir = "tb"',
                sampling={"seed": seed},
            )  # fmt: skip
            rewards = run_grpo(load_run(run), run_file=run, sinks=sinks()).curve
            first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
            assert min(rewards[3:]) > first - 0.1, (dtype, seed, rewards)  # no collapse
            climbs.setdefault(dtype, []).append(last - first)
            gap = max(scalars(tmp / "tb", "policy/sampler_logprob_gap").values())
            gaps[dtype] = max(gaps.get(dtype, 0.0), gap)
    mean = {dtype: float(np.mean(c)) for dtype, c in climbs.items()}
    assert mean["float32"] > 0.1, climbs
    assert mean["bfloat16"] > 0.5 * mean["float32"], climbs
    assert gaps["float32"] < 1e-2 and gaps["bfloat16"] < 0.1, gaps


def test_the_first_pass_ratios_are_exactly_one(chat_model, tmp_path):
    """grpo_epochs = 1: every ratio is 1 (nothing clipped) and the sampler's log-probabilities
    stay close to the trainer's (a float32 cache here)."""
    from retrograd.algorithms.grpo import run_grpo

    run = write_run(
        tmp_path,
        chat_model,
        {"updates": 2, "clip_range_low": 1e-6, "clip_range_high": 1e-6},
        metrics='tensorboard_dir = "tb"',
        training={"lr": 1e-3, "fast_sampling_context": False},
    )
    run_grpo(load_run(run), run_file=run, sinks=sinks())
    tb = tmp_path / "tb"
    for tag in ("policy/clip_fraction", "policy/clip_fraction_low", "policy/clip_fraction_high"):
        clipped = scalars(tb, tag)
        assert clipped and all(v == 0.0 for v in clipped.values()), tag
    for tag in ("policy/ratio_min", "policy/ratio_mean", "policy/ratio_max"):
        assert set(scalars(tb, tag).values()) == {1.0}, tag
    gap = scalars(tb, "policy/sampler_logprob_gap")
    assert gap and all(0 <= v < 1e-4 for v in gap.values()), gap
    # the sampled tokens' mean -log p: an estimate of the entropy, far from 0 on a random model
    assert all(v > 0.5 for v in scalars(tb, "policy/entropy").values())
    assert all(v > 0 for v in scalars(tb, "optimizer/grad_norm").values())
    steps = scalars(tb, "optimizer/steps")
    assert steps and all(v == step for step, v in steps.items()), steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_second_pass_with_the_same_weights_reads_ratios_of_exactly_one(
    chat_model, tmp_path, monkeypatch, dtype
):
    """grpo_epochs = 2 at a rate too small to change any forward value: the second pass scores
    the answers in the first pass's passes (docs/exactness.md, "Batch mates"), so its ratios
    are exactly 1 in either compute dtype, whatever kernels the CPU picks for those shapes."""
    from retrograd.algorithms.grpo import run_grpo

    monkeypatch.setenv("RETRO_DTYPE", dtype)
    run = write_run(
        tmp_path,
        chat_model,
        {"updates": 2, "grpo_epochs": 2},
        metrics='tensorboard_dir = "tb"',
        training={"lr": 1e-30, "micro_batch": 32, "gradient_accumulation": None},
    )
    run_grpo(load_run(run), run_file=run, sinks=sinks())
    tb = tmp_path / "tb"
    assert len(scalars(tb, "optimizer/grad_norm")) >= 1
    for tag in ("policy/ratio_min", "policy/ratio_max"):
        assert set(scalars(tb, tag).values()) == {1.0}, (tag, scalars(tb, tag))


def test_a_small_generation_batch_trains_what_the_default_trains(chat_model, tmp_path, monkeypatch):
    """[training].generation_batch = 2 (each prompt prefilled two positions a pass) with exact
    sampling: the answers of the derived default (64 here: ctx, the tiny vocabulary's logits
    being far below 64 MiB), so the same rewards and the same adapter, byte for byte."""
    from retrograd.algorithms.grpo import run_grpo
    from retrograd.sampling import Sampler

    batches = []
    real = Sampler.prefill
    monkeypatch.setattr(
        Sampler,
        "prefill",
        lambda self, prompts, capacity: (
            batches.append(self.generation_batch) or real(self, prompts, capacity)
        ),
    )
    rewards, adapters, used = [], [], []
    for name, batch in (("default", None), ("small", 2)):
        tmp = tmp_path / name
        tmp.mkdir()
        training = {"generation_batch": batch, "fast_sampling_context": False}
        run = write_run(tmp, chat_model, {"updates": 2}, training=training)
        batches.clear()
        rewards.append(run_grpo(load_run(run), run_file=run, sinks=sinks()).curve)
        used.append(set(batches))
        adapters.append((tmp / "out" / "adapter.gguf").read_bytes())
    assert used == [{64}, {2}]
    assert rewards[0] == rewards[1]
    assert adapters[0] == adapters[1]


def test_rescoring_is_the_same_with_and_without_grad(tiny_model):
    import retrograd
    from retrograd.model.logprobs import sequence_logprobs
    from retrograd.trainable.lora import attach_lora

    m = retrograd.load(tiny_model("gemma3"), device="cpu", dtype=torch.float32)
    attach_lora(m.decoder, ["q", "v"], rank=2, alpha=2.0, seed=0)
    rows = [(list(range(5, 20)), 6), (list(range(30, 41)), 4)]
    with torch.no_grad():
        a = sequence_logprobs(m.decoder, rows)
    b = sequence_logprobs(m.decoder, rows)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y.detach())


def test_the_reference_default_passes_give_the_whole_context_update(chat_model, tmp_path):
    """ctx 128 with the reference's micro_batch (32, gradient_accumulation left out): an
    update's answers go through many small passes (groups split into fan-outs of two answers,
    single rows) and give the update of one pass over everything (micro_batch = ctx)."""
    from gguf import GGUFReader

    from retrograd.algorithms.grpo import run_grpo

    adapters, losses = [], []
    for name, micro in (("default", None), ("whole", 128)):
        tmp = tmp_path / name
        tmp.mkdir()
        training = {"ctx": 128, "micro_batch": micro, "gradient_accumulation": None, "lr": 1e-3}
        run = write_run(
            tmp,
            chat_model,
            {"updates": 1},
            metrics='tensorboard_dir = "tb"',
            training=training,
            sampling={"max_new_tokens": 12},
        )
        cfg = load_run(run)
        assert cfg.training.micro_batch == (micro or 32)
        run_grpo(cfg, run_file=run, sinks=sinks())
        reader = GGUFReader(tmp / "out" / "adapter.gguf")
        adapters.append({t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors})
        losses.append(scalars(tmp / "tb", "policy/surrogate_loss")[1])
    default, whole = adapters
    assert default.keys() == whole.keys() and default
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    # the same step up to float32 summation order (Adam's first step is about lr x sign(grad))
    moved = sum(float(np.abs(v).sum()) for k, v in whole.items() if k.endswith(".lora_b"))
    assert moved > 0
    diff = sum(float(np.abs(default[k] - whole[k]).sum()) for k in whole)
    assert diff < 1e-3 * moved, (diff, moved)


KILLED = {"updates": 6}


def _train(run: Path, *extra: str, wait_for: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "retrograd.cli.main", "train", str(run), *extra]
    env = os.environ | {"RETRO_THREADS": "2"}
    if wait_for is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 600
    while not (wait_for / "manifest.msgpack").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    return subprocess.CompletedProcess(cmd, proc.returncode)


@pytest.mark.slow
def test_resume_after_kill_is_byte_identical(chat_model, tmp_path):
    """Dynamic sampling, shuffled prompts, a KL schedule with an adaptive target: a run killed
    after its checkpoint at step 3 and resumed ends with the uninterrupted run's adapter."""
    model = chat_model
    grpo = {
        **KILLED,
        "prompt_order": "shuffled",
        "kl_coefficient": 0.05,
        "baseline": "leave_one_out",
    }
    sections = {
        "grpo.dynamic_sampling": "max_resample_factor = 2",
        "grpo.kl_schedule": "warmup_updates = 2\ntarget = 0.01",
        "checkpoint": 'directory = "ck"\nmode = "steps"\nevery_steps = 3',
    }
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        write_run(d, model, dict(grpo), **dict(sections))
    done = _train(whole / "run.toml")
    assert done.returncode == 0, done.stderr
    _train(cut / "run.toml", wait_for=cut / "ck" / "step-000000000003.state")
    assert not (cut / "out" / "adapter.gguf").exists()
    resumed = _train(cut / "run.toml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a = (whole / "out" / "adapter.gguf").read_bytes()
    b = (cut / "out" / "adapter.gguf").read_bytes()
    assert a == b


def test_bad_prompt_line_names_file_and_line(chat_model, tmp_path, capsys):
    run = write_run(tmp_path, chat_model)
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    lines[2] = '{"messages": [{"role": "assistant", "content": "hi"}]}'
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"prompts.jsonl:3: .*user message"):
        from retrograd.algorithms.grpo import run_grpo

        run_grpo(load_run(run), run_file=run)


def test_prompt_longer_than_ctx_is_reported(chat_model, tmp_path):
    from retrograd.algorithms.grpo import run_grpo

    run = write_run(tmp_path, chat_model)  # ctx 64
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    lines[4] = json.dumps({"messages": [{"role": "user", "content": "word " * 40}]})
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"prompts.jsonl:5: the prompt renders to \d+ tokens"):
        run_grpo(load_run(run), run_file=run)


def test_cli_trains_grpo_with_observe(chat_model, tmp_path, capsys):
    run = write_run(tmp_path, chat_model, {"updates": 2}, observe='directory = "obs"')
    assert main(["train", str(run)]) == 0
    assert (tmp_path / "out" / "adapter.gguf").exists()
    records = [json.loads(x) for x in (tmp_path / "obs" / "observe.jsonl").read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds[0] == "run" and kinds.count("update") == 2 and kinds.count("outcome") == 2
    rollouts = [r for r in records if r["type"] == "rollout"]
    assert len(rollouts) == 2 * 2 * 8  # updates x prompts x group
    assert all(isinstance(r["completion"], str) and r["reward"] is not None for r in rollouts)
    assert {p.name for p in (tmp_path / "obs").iterdir()} >= {"index.html", "viewer.js", "feed"}


def test_an_update_without_signal_counts_as_an_update_not_a_step(chat_model, tmp_path, capsys):
    """Every answer to "say something" gets the same reward: its update makes no optimizer
    step. The progress counts updates, the summary says both, TensorBoard keeps the step."""
    run = write_run(
        tmp_path,
        chat_model,
        {"updates": 3, "prompts_per_update": 1, "prompt_order": "sequential"},
        metrics='tensorboard_dir = "tb"',
    )
    reward = tmp_path / "reward.py"
    reward.write_text(
        reward.read_text().replace(
            'reward = text.count("e") / max(1, len(text))',
            'reward = 0.5 if req["prompt"] == "say something" else text.count("e") / max(1, len(text))',
        )
    )
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    assert "update 3/3" in out
    summary = out[out.index("run summary") :]
    assert "updates" in summary and "3/3" in summary
    assert "optimizer steps" in summary and "│ 2 " in summary.replace("┃", "│")
    tb = scalars(tmp_path / "tb", "reward/mean")
    assert sorted(tb) == [1, 2]  # the skipped update reports at the step it left unchanged
    skipped = scalars(tmp_path / "tb", "batch/trained_fraction")
    assert 0.0 in skipped.values()


def test_bench_reports_rewards_of_base_and_adapter(chat_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table's full width
    run = write_run(tmp_path, chat_model, {"updates": 2})
    assert main(["train", str(run)]) == 0
    capsys.readouterr()
    adapter = str(tmp_path / "out" / "adapter.gguf")
    code = main(
        [
            "bench",
            str(run),
            "--data",
            str(tmp_path / "prompts.jsonl"),
            "--adapter",
            adapter,
            "--limit",
            "4",
            "--answers",
            "3",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "grpo bench (3 sampled answers per prompt)" in out, out
    assert "base" in out and "adapter.gguf" in out and "± se" in out


def test_held_out_answers_beyond_the_first_keep_the_evaluations_answer(
    chat_model, tmp_path, monkeypatch
):
    """bench --answers N: answer 0 to each prompt is the one a training run's evaluation
    samples (the same seed, the same text, the same reward); the others are other draws.
    float32: a bf16 path rounds a wider batch differently (the docstring's caveat)."""
    monkeypatch.setenv("RETRO_DTYPE", "float32")
    from retrograd.algorithms import context
    from retrograd.algorithms.evaluate import held_out_rewards
    from retrograd.data.prompts import read_prompts, render_prompts
    from retrograd.rewards.program import reward_program
    from retrograd.sampling import Sampler
    from retrograd.sampling.engine import run_settings

    cfg = load_run(write_run(tmp_path, chat_model))
    model = context.load_model(cfg)
    lines = read_prompts(str(tmp_path / "prompts.jsonl"), "prompts")
    prompts = render_prompts(lines, context.chat_format(model), 64)
    sampler = Sampler(model.decoder, model.tokenizer, max_len=64, **run_settings(cfg.training))
    with reward_program(cfg.grpo, "[grpo]") as program:
        one, first = held_out_rewards(sampler, program, prompts, cfg.grpo.sampling)
        many, answers = held_out_rewards(
            sampler, program, prompts, cfg.grpo.sampling, answers_per_prompt=3
        )
    assert len(one) == len(prompts) and len(many) == len(answers) == 3 * len(prompts)
    assert [a.text for a in answers[::3]] == [a.text for a in first]
    assert many[::3] == one
    others = [answers[i : i + 3] for i in range(0, len(answers), 3)]
    assert sum(len({a.text for a in group}) > 1 for group in others) >= len(prompts) // 2


@pytest.mark.parametrize(
    ("algorithm", "answers", "message"),
    [
        ("grpo", "0", "--answers 0: must be 1 to 256"),
        ("grpo", "257", "--answers 257: must be 1 to 256"),
        ("sft", "2", "--answers: samples answers for ppo and grpo runs; a sft run's bench"),
    ],
    ids=["zero", "too-many", "sft"],
)
def test_bench_refuses_answers_it_cannot_sample_before_the_model_loads(
    tmp_path, capsys, algorithm, answers, message
):
    missing = tmp_path / "absent.gguf"  # never opened: the refusal comes first
    (tmp_path / "d.jsonl").write_text("")
    if algorithm == "grpo":
        run = write_run(tmp_path, missing)
    else:
        run = write_run_file(tmp_path, "sft", missing, {"sft": {"data": "d.jsonl"}})
    code = main(["bench", str(run), "--data", str(tmp_path / "d.jsonl"), "--answers", answers])
    assert code != 0
    assert message in capsys.readouterr().err


def phase_seconds(out: str) -> dict[str, float]:
    """The rows of profile's phase table: {phase: seconds}."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃|").split("│")]
        if len(cells) == 3 and cells[2].endswith("%"):
            rows[cells[0]] = float(cells[1])
    return rows


def test_profile_reports_phases_and_writes_nothing(chat_model, tmp_path, capsys):
    run = write_run(
        tmp_path,
        chat_model,
        metrics='tensorboard_dir = "tb"',
        training={"max_gpu_duty_cycle": 0.5},
    )
    assert main(["profile", str(run), "--updates", "1", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    for line in ("peak host memory", "backend: device cpu, compute float32"):
        assert line in out
    assert (
        "duty cycle: gpu_duty_cycle_requested: 0.5; gpu_duty_cycle_active: false; "
        "gpu_duty_cycle_reason: cpu_backend" in out
    )
    assert "grpo, 1 updates x 3 prompts x group 4, 1 epoch(s), up to 4 new tokens" in out
    rows = phase_seconds(out)
    phases = ["initialization", "generation", "reward", "judge", "reference scoring"]
    assert list(rows) == [*phases, "optimizer", "other", "total"], out
    assert rows["generation"] > 0 and rows["reward"] > 0 and rows["optimizer"] > 0, rows
    assert "optimizer steps: 1 (none where every group scored alike)" in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "tb").exists()


def test_profile_refuses_sft_before_loading(chat_model, tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text(
        f'[run]\nalgorithm = "sft"\n[model]\npath = "{chat_model}"\n'
        '[output]\npath = "o.gguf"\n[lora]\n[sft]\ndata = "d.txt"\n'
    )
    (tmp_path / "d.txt").write_text("x")
    assert main(["profile", str(run)]) != 0
    err = capsys.readouterr().err
    assert "profile runs grpo and agent_grpo workloads" in err
    assert "(sft, ppo, preference, distill: `retrograd bench` measures them)" in err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--group-size", "1"], "--group-size 1: must be 2 to 256"),
        (["--micro-batch", "48"], "[training].micro_batch = 48: must divide ctx (64)"),
        (["--prompts", "0"], "--prompts 0: must be at least 1"),
    ],
    ids=["group", "micro-batch", "prompts"],
)
def test_profile_refuses_a_workload_the_rules_refuse(chat_model, tmp_path, capsys, flags, expected):
    """The shortened file is validated again, before the model loads."""
    run = write_run(tmp_path, chat_model)
    assert main(["profile", str(run), *flags]) == 1
    err = capsys.readouterr().err
    assert expected in err, err


FAILING = r"""
import json, sys
batches = 0
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req:
        print(json.dumps(req), flush=True)
    elif "_retrograd_batch_end" in req:
        batches += 1
        if batches == 3:
            print("the third batch breaks me", file=sys.stderr, flush=True)
            print("not json", flush=True)
        print(json.dumps(req), flush=True)
    else:
        print(json.dumps({"reward": len(req["completion"]) % 3,
                          "_retrograd_batch": req["_retrograd_batch"],
                          "_retrograd_index": req["_retrograd_index"]}), flush=True)
"""


def test_a_failing_reward_program_stops_the_run_cleanly(chat_model, tmp_path, monkeypatch):
    from retrograd.algorithms.grpo import run_grpo
    from retrograd.errors import RewardError

    run = write_run(
        tmp_path,
        chat_model,
        {"reward_command": [sys.executable, "failing_reward_x7.py"], "updates": 5},
        checkpoint='directory = "ck"\nmode = "steps"\nevery_steps = 1',
    )
    (tmp_path / "failing_reward_x7.py").write_text(FAILING)
    monkeypatch.chdir(tmp_path)  # the reward command resolves against the working directory
    with pytest.raises(RewardError) as caught:
        run_grpo(load_run(run), run_file=run)
    message = str(caught.value)
    assert "[grpo].reward_command" in message and "the third batch breaks me" in message
    states = sorted(p.name for p in (tmp_path / "ck").glob("step-*.state"))
    assert states and all((tmp_path / "ck" / s / "manifest.msgpack").exists() for s in states)
    assert not (tmp_path / "out" / "adapter.gguf").exists()
    left = subprocess.run(["pgrep", "-f", "failing_reward_x7"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_a_ruler_judge_adds_its_verdict_and_a_failed_group_is_dropped(
    chat_model, tmp_path, monkeypatch
):
    """[grpo.judge] type = "ruler" against the scripted OpenAI-compatible endpoint: the judge
    scores the share of "e" under each line's own rubric; the second request fails (HTTP 500,
    no retries), so that group keeps its verifiable reward but leaves the update."""
    from retrograd.algorithms.grpo import run_grpo
    from tests.factories.scripted_openai import reply, scripted_openai, status

    def verdict(body: dict):
        prompt = body["messages"][0]["content"]
        shown = json.loads(prompt.split("<trajectories>\n")[1].split("\n</trajectories>")[0])
        scores = []
        for t in shown:
            text = t["messages"][-1]["content"]
            share = text.count("e") / max(1, len(text))
            scores.append({"trajectory_id": t["trajectory_id"], "explanation": "", "score": share})
        return reply(json.dumps({"scores": scores}))

    monkeypatch.setenv("GRPO_JUDGE_KEY", "test-key")
    with scripted_openai([verdict, status(500), verdict, verdict]) as api:
        judge = (
            f'type = "ruler"\nbase_url = "{api.base_url}"\nmodel = "judge"\n'
            'api_key_env = "GRPO_JUDGE_KEY"\nmax_retries = 0\ntemperature = 0.0\n'
            "max_concurrency = 1"  # the groups' requests in order: the second one fails
        )
        run = write_run(
            tmp_path,
            chat_model,
            {"updates": 2, "judge_weight": 1.0},
            metrics='tensorboard_dir = "tb"',
            **{"grpo.judge": judge},
        )
        lines = [
            json.dumps({"messages": [{"role": "user", "content": p}], "rubric": "Count the e."})
            for p in PROMPTS
        ]
        (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
        run_grpo(load_run(run), run_file=run, sinks=sinks())
    assert len(api.requests) == 4  # one listwise request per group, 2 groups x 2 updates
    for body in api.requests:
        assert body["messages"][0]["content"].startswith("Count the e.")
        assert body["temperature"] == 0.0
    tb = tmp_path / "tb"
    assert scalars(tb, "judge/dropped_group_fraction") == {1: 0.5, 2: 0.0}
    assert scalars(tb, "judge/groups") == {1: 1.0, 2: 2.0}
    judged = scalars(tb, "reward/judge_mean")
    verifiable = scalars(tb, "reward/verifiable_mean")
    assert set(judged) == {1, 2}
    # the judge scores what the reward program scores: in update 2, every group judged, the
    # mean judge term equals the verifiable mean
    assert judged[2] == pytest.approx(verifiable[2], abs=1e-5)
