"""Supervised fine-tuning on text or chat data: a LoRA adapter, base tensors or both (the plan).

Departures from a textbook SFT loop, all from the reference:
- a window of ctx tokens runs in passes of micro_batch tokens that see earlier passes only as
  (gradient-free) context; gradient_accumulation passes make an optimizer step (step.py);
- the loss of a step is the mean over its trained tokens (assistant tokens for chat data);
- the epoch's order is a pure function of ([lora].seed, epoch), so resume needs no RNG state;
  a checkpoint inside a window keeps the window's keys and values (an artifact);
- the learning rate is a pure function of the step (optim.lr_at);
- under torchrun each rank runs its share of a step's passes and the ranks' gradients and
  losses are summed before the step (distributed.Replicas).

Phases: 1. build (model, data), open the run (plan, optimizer, resume: frame.py)  2. a step:
one group of passes over an example's window, backward, the checked optimizer step  3. report,
evaluate after an epoch's last step, checkpoint, stop early (frame.after_step)  4. export and
summarize (frame.finish). Offline distillation (distill_offline.py) runs `fit` with its own
corpus and loss.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from retrograd import distributed
from retrograd.algorithms import context, frame
from retrograd.algorithms.door import Door
from retrograd.algorithms.evaluate import Evaluation, perplexity, sft_loss
from retrograd.algorithms.step import (
    Group,
    LossOptions,
    PassLoss,
    backward_group,
    groups_of,
    new_cache,
    restore_window,
    window_bytes,
)
from retrograd.data.sft import Example, SFTDataset, infer_format, load_sft_data, permutation
from retrograd.errors import CheckpointError
from retrograd.model.kv_cache import KVCache
from retrograd.observe import names

log = logging.getLogger(__name__)
WINDOW = "window-kv.msgpack"  # artifact: the keys and values of a window cut by a checkpoint
PROBE_EXAMPLES = 64  # what a client's evaluate of an offline distillation run measures


def load_data(cfg, model) -> tuple[SFTDataset, SFTDataset | None]:
    """The training file and the held-out one, tokenized; chat data through the model's template."""
    ctx, fmt = cfg.training.ctx, cfg.sft.data_format
    paths = [cfg.sft.data] + ([cfg.evaluation.data] if cfg.evaluation is not None else [])
    chat_fmt = None
    if any(infer_format(Path(p), fmt) == "jsonl" for p in paths):
        chat_fmt = context.chat_format(model, cfg.sft.template_variables)
    sets = [load_sft_data(p, model.tokenizer, ctx, fmt, chat_fmt) for p in paths]
    return sets[0], (sets[1] if len(sets) > 1 else None)


def total_steps(data: SFTDataset, training, epochs: int | None = None) -> int:
    """Optimizer steps of the run: groups with a trained token only (step.groups_of)."""
    per_epoch = sum(
        len(groups_of(e, training.micro_batch, training.gradient_accumulation))
        for e in data.examples
    )
    return per_epoch * (training.epochs if epochs is None else epochs)


def order_of(data: SFTDataset, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    n = len(data.examples)
    return permutation(n, seed, epoch) if shuffle else np.arange(n)


@dataclass
class Corpus:
    """What `fit` trains on and how: SFT's file, or offline distillation's corpus with its
    teacher's predictions (algorithms/distill_offline.py), which runs the same steps."""

    train: SFTDataset
    held: SFTDataset | None
    epochs: int
    shuffle: bool
    fingerprints: dict  # what resume checks: the data files' fingerprints
    settings: dict  # the algorithm's keys that change a step
    pass_loss: Callable[[int], PassLoss | None] = lambda example: None  # None: the NLL


def run_sft(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    # 1. build: what the run writes is checked before anything loads
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    model = frame.model_of(cfg, door)
    t0 = time.perf_counter()
    train, held = load_data(cfg, model)
    log.info("data loaded in %.2f s: %s", time.perf_counter() - t0, train.describe())
    corpus = Corpus(
        train,
        held,
        cfg.training.epochs,
        cfg.sft.shuffle,
        {"train": train.fingerprint, "eval": held.fingerprint if held is not None else None},
        {"shuffle": cfg.sft.shuffle, "template_variables": dict(cfg.sft.template_variables)},
    )
    return fit(cfg, model, corpus, door)


def fit(cfg, model, corpus: Corpus, door: Door) -> frame.Result:
    """The SFT loop over `corpus` with the loaded model (the phases of the module docstring)."""
    t, train, held = cfg.training, corpus.train, corpus.held
    inputs = frame.Inputs(
        corpus.fingerprints,
        corpus.settings,
        (train.path, train.describe()),
        (held.path, held.describe()) if held is not None else None,
    )
    shape = frame.Shape(
        total_steps(train, t, corpus.epochs), corpus.epochs, "step", names.TRAIN_LOSS
    )
    run = frame.open_run(cfg, model, door, inputs, shape)
    run = frame.evaluate_with(run, _evaluation(cfg, model, corpus, run.replicas.sharded))
    opts = LossOptions(t.chunked_cross_entropy, t.chunked_ce_tiles, t.chunked_ce_seq_chunk)
    pos = run.position
    with run.closing:
        for s in _steps(run, corpus, context.kv_dtype(model, t)):
            began, before = time.perf_counter(), pos.global_step
            # 2. this rank's passes of the group; the ranks' gradients and losses summed
            mine = set(distributed.share(len(s.group.passes)))
            passes = (corpus.pass_loss(s.example_id), mine, run.replicas.sharded)
            loss = backward_group(model.decoder, s.example, s.group, s.cache, opts, *passes)
            (loss,) = run.replicas.sum_step(run.tr.params, loss)
            where = f"step {pos.global_step + 1} ({s.example.where})"
            rate, _ = frame.optimizer_step(run, pos.global_step, loss, where)
            pos = _advance(pos, s)
            # 3. report; evaluate after an epoch's last step; a checkpoint inside a window
            # keeps the window's keys and values
            window = (
                {WINDOW: partial(window_bytes, s.cache, s.group.end)} if pos.at["group"] else {}
            )
            tokens = sum(e - b for b, e in s.group.passes)
            log.debug(
                "step %d (%s, group %d/%d): %d tokens, loss %.4f, lr %.3g, %.3f s",
                pos.global_step, s.example.where, s.g + 1, len(s.groups), tokens, loss, rate,
                time.perf_counter() - began,
            )  # fmt: skip
            report = frame.Report(
                {names.TRAIN_LOSS: loss, names.LEARNING_RATE: rate},
                tokens,
                began,
                s.epoch,
                before,
                iteration_done=pos.epoch == s.epoch + 1,
                artifacts=window,
            )
            if frame.after_step(run, pos, report):
                break
    # 4. export; if that fails, the trained result is kept elsewhere and the error says where
    return frame.finish(run, pos)


@dataclass(frozen=True)
class Step:
    """One optimizer step of the epoch: group `g` of example `index` of its order."""

    epoch: int
    index: int
    examples: int  # in the epoch's order
    example_id: int
    example: Example
    groups: list[Group]
    g: int
    cache: KVCache

    @property
    def group(self) -> Group:
        return self.groups[self.g]


def _steps(run: frame.Run, corpus: Corpus, kv) -> Iterator[Step]:
    """The run's steps from its position on: a resumed window starts from the keys and values
    its checkpoint kept."""
    pos, t, decoder = run.position, run.cfg.training, run.model.decoder
    window = _restored_window(run)
    for epoch in range(pos.epoch, corpus.epochs):
        order = order_of(corpus.train, run.tr.plan.seed, epoch, corpus.shuffle)
        for i in range(pos.index if epoch == pos.epoch else 0, len(order)):
            example = corpus.train.examples[order[i]]
            groups = groups_of(example, t.micro_batch, t.gradient_accumulation)
            first = pos.at.get("group", 0) if (epoch, i) == (pos.epoch, pos.index) else 0
            if first:  # inside a window: its earlier passes' keys and values, as they were
                cache = restore_window(window, decoder, example, kv, groups[first - 1].end)
            else:
                cache = new_cache(decoder, example, kv)
            for g in range(first, len(groups)):
                yield Step(epoch, i, len(order), int(order[i]), example, groups, g, cache)


def _restored_window(run: frame.Run) -> bytes | None:
    """The keys and values a checkpoint cut inside a window kept (None between examples)."""
    if run.restored is None or not run.position.at.get("group", 0):
        return None
    window = run.restored.artifacts.get(WINDOW)
    if window is None:
        raise CheckpointError(
            f"cannot resume from {run.source}: it stops inside a window but holds no window "
            "cache (written by an earlier version); resume from a checkpoint between examples"
        )
    return window


def _advance(pos: frame.Position, s: Step) -> frame.Position:
    """The position after step `s`: the next group, example or epoch."""
    step = pos.global_step + 1
    if s.g + 1 < len(s.groups):
        return frame.Position(step, s.epoch, 0, s.index, {"group": s.g + 1})
    if s.index + 1 < s.examples:
        return frame.Position(step, s.epoch, 0, s.index + 1, {"group": 0})
    return frame.Position(step, s.epoch + 1, 0, 0, {"group": 0})


# -- evaluation -------------------------------------------------------------------------------


def _evaluation(cfg, model, corpus: Corpus, sharded: bool) -> Evaluation:
    """The held-out loss (patience reads eval/loss; `sharded`: the run's Replicas.sharded);
    what a client's evaluate measures: the held-out data, or for offline distillation (no
    [evaluation]) its corpus's first examples."""
    offline = cfg.run.algorithm == "distill"
    probe, limit = (corpus.train, PROBE_EXAMPLES) if offline else (corpus.held, None)
    held = corpus.held
    scheduled = (lambda c: _held_loss(c, model, held, sharded)) if held is not None else None
    return Evaluation(
        scheduled, names.EVAL_LOSS, measure=lambda c: _measure(c, model, probe, limit)
    )


def _measure(cfg, model, data: SFTDataset | None, limit: int | None = None) -> dict | None:
    """Loss and perplexity on `data`'s trained tokens with the weights as they are (None
    without data), one process (a client's question to a served run); patience is not told."""
    if data is None:
        return None
    loss, _ = _loss(cfg, model, data, limit)
    examples = len(data.examples[:limit])
    return {"examples": examples, "loss": loss, "perplexity": perplexity(loss)}


def _held_loss(cfg, model, held: SFTDataset, sharded: bool) -> dict[str, float]:
    """eval/loss and eval/perplexity of the held-out set: each rank its block of it, summed;
    `sharded` (fsdp2) every rank all of it (the passes are collectives)."""
    mine = range(len(held.examples)) if sharded else distributed.share(len(held.examples))
    part = dataclasses.replace(held, examples=tuple(held.examples[k] for k in mine))
    loss, count = _loss(cfg, model, part)
    if distributed.world().active and not sharded:
        total, count = distributed.all_reduce_sum([loss * count if count else 0.0, count])
        loss = total / count if count else float("nan")
    return {names.EVAL_LOSS: loss, names.EVAL_PERPLEXITY: perplexity(loss)}


def _loss(cfg, model, data: SFTDataset, limit: int | None = None) -> tuple[float, int]:
    t = cfg.training
    return sft_loss(
        model.decoder,
        data,
        limit,
        seq_chunk=t.chunked_ce_seq_chunk,
        chunked=t.chunked_cross_entropy,
        tiles=t.chunked_ce_tiles,
    )
