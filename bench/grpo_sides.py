"""The sides of bench/grpo.py, one per process: the same GRPO update by TRL and by Retrograd.

Holds the settings both sides share (the prompts, the reward, the group, the LoRA, the loss),
how each side's update is cut into phases, and the two workers: TRL's GRPOTrainer on the model
as transformers loads the GGUF, and our `run_grpo`. Each worker returns a dict of plain numbers;
the driver and the report are bench/grpo.py's. The model, the LoRA and the memory readings are
bench/sft_sides.py's, so that the two benchmarks measure the peers the same way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import time
from pathlib import Path

from bench.sft_sides import (
    ALPHA,
    OURS_TARGETS,
    RANK,
    gemma,
    hf_model,
    hwm_mib,
    lora_config,
    maxrss_mib,
    parse_variant,
    reset_hwm,
)
from bench.sft_sides import RUN_FILE as SFT_RUN_FILE

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "bench/grpo-prompts.jsonl"
REWARD = ROOT / "examples/rewards/arithmetic.py"
LR = 2e-4
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
PHASES = ("generation", "reward", "scoring", "optimizer")


def phases_of(ends: list[float], parts: list[dict], warmup: int) -> list[dict]:
    """Per timed update: each phase's seconds, `total` (the wall time between the ends of
    consecutive updates) and `other` (total minus the phases: logging, bookkeeping)."""
    out = []
    for (a, b), part in zip(itertools.pairwise(ends[warmup - 1 :]), parts[warmup:], strict=True):
        row = {k: part.get(k, 0.0) for k in PHASES} | {"total": b - a}
        row["other"] = row["total"] - sum(row[k] for k in PHASES)
        out.append({k: round(v, 3) for k, v in row.items()})
    return out


def arithmetic_score():
    """examples/rewards/arithmetic.py's `score(prompt, completion)`: the program ours runs."""
    spec = importlib.util.spec_from_file_location("arithmetic_reward", REWARD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


# -- TRL: GRPOTrainer ------------------------------------------------------------------------


def worker_trl(args) -> dict:
    """GRPOTrainer, one optimizer step per update over the update's 32 answers, generated in
    one `generate` call (no vLLM). Phases, by wrapping the trainer's own methods:
    generation = `_generate` (prompt tokenization, transformers' generate, decoding);
    reward = `_calculate_rewards`; scoring = the rest of `_generate_and_score_completions`
    (old and reference log-probabilities where computed, advantages, padding); optimizer =
    from its end to the step's end (forward, backward, clipping, AdamW step)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    _, autocast, flags = parse_variant(args.variant)
    path, workdir = gemma(), Path(args.workdir)
    shared = json.loads((workdir / "prompts.json").read_text())
    model = hf_model(args.variant)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # NOTE: the GGUF has no chat template; ours renders llama.cpp's gemma format, and so does
    # this one (with the BOS our tokenizer adds); the ids are compared below.
    tokenizer.chat_template = shared["template"]
    theirs = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        for m in shared["messages"]
    ]
    theirs = [list(t["input_ids"] if hasattr(t, "keys") else t) for t in theirs]
    same = sum(a == b for a, b in zip(theirs, shared["ids"], strict=True))
    score = arithmetic_score()

    def arithmetic(prompts, completions, **_):
        return [
            score(p[-1]["content"], c[0]["content"])
            for p, c in zip(prompts, completions, strict=True)
        ]

    answers = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(workdir / f"trl-{args.variant}"),
        use_cpu=True,
        bf16=autocast,
        gradient_checkpointing="gc" in flags,
        per_device_train_batch_size=answers,  # the whole update in one pass, one step
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.new,
        generation_kwargs={"min_new_tokens": args.new},  # every answer exactly args.new tokens
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="none",  # ours: reward minus the group's mean, no division (Dr. GRPO)
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.warmup + args.updates,
        shuffle_dataset=False,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    ends: list[float] = []
    parts: list[dict] = [{}]
    threads: list[int] = []
    begun: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            reset_hwm()
            begun.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            parts[-1]["optimizer"] = now - parts[-1].pop("scored")
            ends.append(now)
            parts.append({})
            threads.append(torch.get_num_threads())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[arithmetic],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": shared["messages"]}),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[Clock()],
    )

    def timed(fn, name):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            parts[-1][name] = parts[-1].get(name, 0.0) + time.perf_counter() - t
            return out

        return call

    generate_and_score = trainer._generate_and_score_completions

    def scored(*a, **k):
        t = time.perf_counter()
        out = generate_and_score(*a, **k)
        now = time.perf_counter()
        part = parts[-1]
        part["scoring"] = now - t - part.get("generation", 0.0) - part.get("reward", 0.0)
        part["scored"] = now
        return out

    trainer._generate = timed(trainer._generate, "generation")
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "reward")
    trainer._generate_and_score_completions = scored
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "updates": phases_of(ends, parts[:-1], args.warmup),
        "first_update_s": ends[0] - begun[0],
        "maxrss_mib": maxrss_mib(),
        "train_peak_mib": hwm_mib(),
        "reward_mean": [round(h["reward"], 4) for h in logs],
        "answer_tokens": [h["completions/mean_length"] * answers for h in logs],
        "zero_std_groups": [h["frac_reward_zero_std"] for h in logs],
        "prompt_ids_equal": f"{same} of {len(theirs)}",
        "attention": model.config._attn_implementation,
        "optimizer_kind": type(trainer.optimizer.optimizer).__name__,
        "threads": max(threads),
    }


# -- ours: run_grpo ----------------------------------------------------------------------------

# [run] to [lora] as bench/sft_sides.py writes them, for algorithm "grpo"
RUN_FILE = (
    SFT_RUN_FILE[: SFT_RUN_FILE.index("[training]")].replace('"sft"', '"grpo"')
    + """\
[training]
threads = {threads}
lr = {lr}
lr_scheduler = "constant"
ctx = {ctx}
micro_batch = {ctx}

[grpo]
prompts = "{prompts}"
reward_command = {reward}
updates = {updates}
prompts_per_update = {prompts_per_update}
group_size = {group}
grpo_epochs = 1
clip_range_low = {clip_low}
clip_range_high = {clip_high}
kl_coefficient = 0.0
prompt_order = "sequential"

[grpo.sampling]
temperature = 1.0
top_p = 1.0
max_new_tokens = {new}
seed = 1
"""
)


def ignore_end_of_generation() -> None:
    """Make our sampler ignore end-of-generation ids in this process (the bench only): every
    answer runs to max_new_tokens, as TRL's with min_new_tokens."""
    from retrograd.sampling import Sampler

    make_rows = Sampler.make_rows

    def rows(self, request, entry=None):
        params = dataclasses.replace(request.params, stop_ids=frozenset())
        return make_rows(self, dataclasses.replace(request, params=params), entry)

    Sampler.make_rows = rows


def worker_ours(args) -> dict:
    """`run_grpo` from a run file. Phases, as the loop reports them per update
    (timing/* values): generation = sampling the groups (Sampler.generate: prefill once
    per group, batched decode, decoding); reward = the reward program's batch (a
    subprocess over the persistent protocol); scoring = reference log-probabilities (none
    at kl_coefficient 0: the old ones come from the optimizer pass itself); optimizer =
    the grpo_epochs passes (forward, backward, clipping, AdamW step)."""
    import sys

    from retrograd.algorithms.grpo import run_grpo

    ignore_end_of_generation()
    workdir = Path(args.workdir)
    run_file = workdir / "run.toml"
    run_file.write_text(
        RUN_FILE.format(
            model=gemma().as_posix(),
            rank=RANK,
            alpha=ALPHA,
            targets=json.dumps(OURS_TARGETS),
            threads=args.threads,
            lr=LR,
            ctx=args.ctx,
            prompts=PROMPTS.as_posix(),
            reward=json.dumps([sys.executable, REWARD.as_posix()]),
            updates=args.warmup + args.updates,
            prompts_per_update=args.prompts,
            group=args.group,
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            new=args.new,
        )
    )
    return measure_ours(args, run_grpo, run_file)


def measure_ours(args, loop, run_file: Path) -> dict:
    """Run one of our rollout loops (`run_grpo`, `run_ppo`) on `run_file` and time it the same
    way: phases as its timing/* values per update, the update's end at its sinks' step."""
    import torch

    from retrograd.config import load_run
    from retrograd.observe import names
    from retrograd.observe.sinks import Sinks

    keys = {
        "generation": names.GENERATION_SECONDS,
        "reward": names.REWARD_SECONDS,
        "scoring": names.SCORING_SECONDS,
        "optimizer": names.OPTIMIZER_SECONDS,
    }
    ends: list[float] = []
    parts: list[dict] = []
    seen: list[dict] = []
    begun: list[float] = []
    info: dict = {}

    class Clock(Sinks):
        def start(self, start):
            super().start(start)
            info.update(dtype=start.dtype, cache=start.backend)
            reset_hwm()
            begun.append(time.perf_counter())

        def step(self, global_step, update, values, tokens, seconds, position=None):
            ends.append(time.perf_counter())
            parts.append({k: values.get(v, 0.0) for k, v in keys.items()})
            seen.append(
                {
                    "reward": values[names.REWARD_MEAN],
                    "tokens": tokens,
                    "trained": values.get(names.TRAINED_FRACTION, 0.0),
                }
            )

    loop(load_run(run_file), sinks=Clock(quiet=True), run_file=run_file)
    return {
        "updates": phases_of(ends, parts, args.warmup),
        "first_update_s": ends[0] - begun[0],
        "maxrss_mib": maxrss_mib(),
        "train_peak_mib": hwm_mib(),
        "reward_mean": [round(s["reward"], 4) for s in seen],
        "answer_tokens": [s["tokens"] for s in seen],
        "trained_fraction": [s["trained"] for s in seen],
        "threads": torch.get_num_threads(),
    } | info
