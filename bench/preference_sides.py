"""The sides of bench/preference.py, one per process: the same DPO steps by TRL and by Retrograd.

Holds the settings both sides share (the pairs, the LoRA, the loss, the optimizer), the pairs'
construction, and the two workers: TRL's DPOTrainer on the model as transformers loads the
GGUF, and our `run_preference`. Each worker returns a dict of plain numbers; the driver and the
report are bench/preference.py's. The model, the LoRA and the memory readings are
bench/sft_sides.py's, so that the benchmarks measure the peers the same way.
"""

from __future__ import annotations

import itertools
import json
import statistics
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
SOURCE = ROOT / "examples/preference/plurals.jsonl"
LR, BETA = 5e-5, 0.1


# -- the pairs -------------------------------------------------------------------------------


def nouns() -> list[tuple[str, str, str]]:
    """(noun, its plural, the wrong plural) of each pair of examples/preference/plurals.jsonl."""
    out = []
    for line in SOURCE.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        noun = r["prompt"][-1]["content"].removeprefix("Plural of ").removesuffix(":")
        out.append((noun, r["chosen"][0]["content"], r["rejected"][0]["content"]))
    return out


def grow(head: str, words, count, target: int) -> str:
    """`head` then words from `words`, comma-separated, until `count` of the text reaches
    `target` (one word past it at most)."""
    text = head
    for i, w in enumerate(words):
        if count(text) >= target:
            break
        text += (", " if i else " ") + w
    return text


def make_pairs(chat, n: int, prompt_tokens: int, answer_tokens: int) -> list[dict]:
    """n pairs, deterministic, built from the plurals of examples/preference/plurals.jsonl:
    pair i asks for the plural of noun i after a list of nouns with their plurals, padded to
    about `prompt_tokens` prompt ids (chat-rendered, BOS and generation prompt included); the
    chosen answer is the plural and then more plurals, the rejected one the wrong plural and
    then more wrong plurals, each padded to about `answer_tokens` written tokens (its
    <end_of_turn> included)."""
    table = nouns()
    tok = chat.tokenizer

    def content(text: str) -> int:
        return len(tok.tokenize(text, add_bos=False))

    framing = len(chat.prompt_ids([{"role": "user", "content": "x"}])) - content("x")
    out = []
    for i in range(n):
        noun, plural, wrong = table[i % len(table)]
        rest = [table[(i + k) % len(table)] for k in range(1, len(table))]
        question = f". Plural of {noun}:"
        examples = grow(
            "Nouns and their plurals:",
            (f"{a} {b}" for a, b, _ in rest),
            lambda t, q=question: content(t + q),
            prompt_tokens - framing,
        )
        chosen = grow(
            f"{plural}. More plurals:", (b for _, b, _ in rest), content, answer_tokens - 1
        )
        rejected = grow(
            f"{wrong}. More plurals:", (c for _, _, c in rest), content, answer_tokens - 1
        )
        out.append(
            {
                "prompt": [{"role": "user", "content": examples + question}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return out


def token_pairs(path: Path, ctx: int) -> list[dict]:
    """The pairs of the file as `retrograd train` sees them: prompt ids, and each answer's
    ids (trailing template framing dropped) and train mask."""
    from retrograd.algorithms.context import file_chat_format
    from retrograd.data.pairs import read_pairs, tokenize_pairs

    pairs = tokenize_pairs(read_pairs(path), file_chat_format(gemma()), ctx)
    return [
        {
            "prompt": list(p.prompt),
            "chosen": list(p.chosen),
            "rejected": list(p.rejected),
            "written": [sum(p.chosen_mask), sum(p.rejected_mask)],
        }
        for p in pairs
    ]


# -- timing ------------------------------------------------------------------------------------


def summary(ends: list[float], warmup: int, per_step: int, reference_s: float, n: int) -> dict:
    """The timed steps (after `warmup`: the wall time between consecutive steps' ends), the
    reference phase (every pair once), and pairs per second of each and of both together."""
    times = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    step_s = statistics.mean(times)
    ref_pair_s = reference_s / n
    return {
        "step_s": step_s,
        "times": [round(t, 3) for t in times],
        "train_pairs_s": per_step / step_s,
        "reference_s": reference_s,
        "reference_pairs_s": n / reference_s,
        # a pair costs its share of a training step plus its one reference scoring
        "pairs_s": 1 / (step_s / per_step + ref_pair_s),
        "maxrss_mib": maxrss_mib(),
        "train_peak_mib": hwm_mib(),
    }


def mean_of(values) -> float:
    return round(statistics.mean(float(v) for v in values), 4)


# -- TRL: DPOTrainer ---------------------------------------------------------------------------


def worker_trl(args) -> dict:
    """DPOTrainer with precompute_ref_log_probs: the reference log-probabilities of every pair
    (PEFT's adapter disabled, no second model) are computed once, in the trainer's constructor
    (`_precompute_ref_logps`, timed by wrapping it), then `--pairs` pairs an optimizer step:
    `--trl-batch` pairs a forward (each pair two rows, prompt + chosen and prompt + rejected,
    padded to the batch's longest), accumulated over pairs / batch passes."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    _, autocast, flags = parse_variant(args.variant)
    path, workdir = gemma(), Path(args.workdir)
    shared = json.loads((workdir / "pairs.json").read_text())
    model = hf_model(args.variant)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # NOTE: the GGUF has no chat template; ours renders llama.cpp's gemma format, and so does
    # this one (with the BOS our tokenizer adds); the ids are compared below.
    tokenizer.chat_template = shared["template"]
    batch = args.batch
    assert args.pairs % batch == 0, f"--trl-batch {batch} must divide --pairs {args.pairs}"
    config = DPOConfig(
        output_dir=str(workdir / f"trl-{args.variant}-b{batch}"),
        use_cpu=True,
        bf16=autocast,
        gradient_checkpointing="gc" in flags,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=args.pairs // batch,
        precompute_ref_log_probs=True,
        loss_type=["sigmoid"],
        beta=BETA,
        max_length=None,  # pairs are never cut, as ours
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.warmup + args.steps,
        train_sampling_strategy="sequential",  # our order (shuffle = false)
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    ends: list[float] = []
    threads: list[int] = []
    reference: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            threads.append(torch.get_num_threads())

    precompute = DPOTrainer._precompute_ref_logps

    def timed(self, *a, **k):
        reset_hwm()  # the high-water mark from the reference phase on, as ours
        t = time.perf_counter()
        out = precompute(self, *a, **k)
        reference.append(time.perf_counter() - t)
        return out

    DPOTrainer._precompute_ref_logps = timed
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(shared["messages"]),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[Clock()],
    )
    data = trainer.train_dataset
    same = compare_ids(shared["ids"], data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])
    same["framing_text"] = [tokenizer.decode(list(f)) for f in same["framing_ids"]]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    n = len(shared["ids"])
    return summary(ends, args.warmup, args.pairs, sum(reference), n) | {
        "ids": same,
        "reference_logps": [mean_of(data["ref_chosen_logps"]), mean_of(data["ref_rejected_logps"])],
        "losses": [round(h["loss"], 4) for h in logs],
        "attention": model.config._attn_implementation,
        "optimizer_kind": type(trainer.optimizer.optimizer).__name__,
        "threads": max(threads),
    }


def compare_ids(ours: list[dict], prompts, chosen, rejected) -> dict:
    """How TRL's ids of each pair compare with ours: prompts equal; answers equal, or equal but
    for framing TRL keeps after the last written token (ours drops it; TRL scores it)."""
    out = {"pairs": len(ours), "prompts_equal": 0, "answers_equal": 0, "answers_plus_framing": 0}
    extra: set[tuple[int, ...]] = set()
    for o, p, c, r in zip(ours, prompts, chosen, rejected, strict=True):
        out["prompts_equal"] += o["prompt"] == list(p)
        for mine, theirs in ((o["chosen"], list(c)), (o["rejected"], list(r))):
            if mine == theirs:
                out["answers_equal"] += 1
            elif theirs[: len(mine)] == mine:
                out["answers_plus_framing"] += 1
                extra.add(tuple(theirs[len(mine) :]))
    out["framing_ids"] = sorted(extra)
    return out


# -- ours: run_preference ------------------------------------------------------------------------

# [run] to [lora] as bench/sft_sides.py writes them, for algorithm "preference"
RUN_FILE = (
    SFT_RUN_FILE[: SFT_RUN_FILE.index("[training]")].replace('"sft"', '"preference"')
    + """\
[training]
threads = {threads}
lr = {lr}
lr_scheduler = "constant"
weight_decay = 0.0
max_grad_norm = 1.0
ctx = {ctx}
micro_batch = {ctx}

[preference]
data = "pairs.jsonl"
loss = "dpo"
beta = {beta}
reference = "base"
shuffle = false
pairs_per_step = {pairs}
"""
)


def worker_ours(args) -> dict:
    """`run_preference` from a run file: the reference scores of every pair first (the
    adapter off, `reference_scores`, timed by wrapping it), then `--pairs` pairs a step, each
    pair one pass (its prompt once, both answers attending to it: shared_prefix_fanout auto)."""
    import torch

    import retrograd.algorithms.pairs as pairs
    import retrograd.algorithms.preference as preference
    from retrograd.config import load_run
    from retrograd.observe import names
    from retrograd.observe.sinks import Sinks

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
            beta=BETA,
            pairs=args.pairs,
        )
    )
    ends: list[float] = []
    losses: list[float] = []
    reference: list[float] = []
    scores: dict = {}
    info: dict = {}

    class Clock(Sinks):
        def start(self, start):
            super().start(start)
            info.update(dtype=start.dtype, cache=start.backend)
            reset_hwm()

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            ends.append(time.perf_counter())
            losses.append(round(values[names.PREFERENCE_LOSS], 4))

    reference_scores = pairs.reference_scores

    def timed(*a, **k):
        t = time.perf_counter()
        out = reference_scores(*a, **k)
        reference.append(time.perf_counter() - t)
        scores.update(out)
        return out

    pairs.reference_scores = timed  # run_preference calls it through the module
    preference.run_preference(load_run(run_file), sinks=Clock(quiet=True), run_file=run_file)
    n = len(scores["train"].chosen)
    return (
        summary(ends, args.warmup, args.pairs, sum(reference), n)
        | info
        | {
            "reference_logps": [mean_of(scores["train"].chosen), mean_of(scores["train"].rejected)],
            "losses": losses,
            "threads": torch.get_num_threads(),
        }
    )
