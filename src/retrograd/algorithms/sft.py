"""Supervised fine-tuning on text or chat data: a LoRA adapter, base tensors or both (the plan).

Departures from a textbook SFT loop, all from the reference:
- a window of ctx tokens runs in passes of micro_batch tokens that see earlier passes only as
  (gradient-free) context; gradient_accumulation passes make an optimizer step (step.py);
- the loss of a step is the mean over its trained tokens (assistant tokens for chat data);
- the epoch's order is a pure function of ([lora].seed, epoch), so resume needs no RNG state;
- the learning rate is a pure function of the step (optim.lr_at).

Phases: 1. build (model, data, plan, optimizer)  2. resume  3. train (steps, metrics,
checkpoints)  4. evaluate and stop early  5. export the adapter and summarize.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd import distributed
from retrograd.algorithms import context, frame, persist
from retrograd.algorithms.evaluate import Patience, epoch_evaluation_due, perplexity, sft_loss
from retrograd.algorithms.step import (
    LossOptions,
    PassLoss,
    backward_group,
    checked_step,
    groups_of,
    new_cache,
    restore_window,
    window_bytes,
)
from retrograd.checkpoint import DatasetPosition, outputs
from retrograd.data.sft import SFTDataset, infer_format, load_sft_data, permutation
from retrograd.errors import CheckpointError
from retrograd.observe import names
from retrograd.optim import lr_at

log = logging.getLogger(__name__)
WINDOW = "window-kv.msgpack"  # artifact: the keys and values of a window cut by a checkpoint
PROBE_EXAMPLES = 64  # what a client's evaluate of an offline distillation run measures


@dataclass
class Position:
    """Where the loop is: resume continues from exactly here."""

    epoch: int = 0
    index: int = 0  # position in the epoch's permutation
    group: int = 0  # optimizer-step group within the example
    global_step: int = 0

    def mark(self, window=None) -> persist.Mark:
        """What a checkpoint keeps; `window` gives the cache bytes inside a window."""
        return persist.Mark(
            self.global_step,
            epoch=self.epoch,
            dataset=DatasetPosition(self.epoch, self.index, {"group": self.group}),
            artifacts={WINDOW: window} if window is not None else {},
        )

    @classmethod
    def restored(cls, state, source: str) -> tuple[Position, bytes | None]:
        """The position a checkpoint holds and, inside a window, its saved keys and values."""
        ds = state.dataset
        pos = cls(ds.epoch, ds.index, int(ds.extra.get("group", 0)), state.global_step)
        window = state.artifacts.get(WINDOW)
        if pos.group and window is None:
            raise CheckpointError(
                f"cannot resume from {source}: it stops inside a window but holds no window "
                "cache (written by an earlier version); resume from a checkpoint between examples"
            )
        return pos, window


@dataclass
class SFTResult:
    output: Path
    global_step: int
    epochs_done: int
    best_eval: float | None
    stopped_early: bool
    seconds: float
    tokens: int
    last_loss: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    last_eval_improved: bool = False


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


def run_sft(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> SFTResult:
    door = frame.door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    # 1. build: what the run writes is checked before anything loads
    outputs.check_outputs(cfg, door.run_file)
    model = context.load_model(cfg)
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


def fit(cfg, model, corpus: Corpus, door) -> SFTResult:
    """The SFT loop over `corpus` with the loaded model: plan, resume, steps, evaluation,
    checkpoints, export."""
    resume, run_file, sinks = door.resume, door.run_file, persist.Legacy(door)
    started = time.perf_counter()
    training = cfg.training
    train, held = corpus.train, corpus.held
    context.preflight_check(model, training, getattr(sinks, "console", None))
    context.apply_memory_knobs(model, training)
    tr = context.trainables(model, cfg)
    plan, trained, named, params, optimizer, rate = (
        tr.plan, tr.trained, tr.named, tr.params, tr.optimizer, tr.rate
    )  # fmt: skip
    steps = total_steps(train, training, corpus.epochs)
    # under torchrun each rank trains its share of every step's passes (docs/distributed.md)
    replicas = distributed.wrap_trainable(model, tr)
    run = persist.RunIdentity.of(cfg, model.config.name, corpus.fingerprints, plan, corpus.settings)

    # 2. resume
    pos, window = Position(), None
    patience = Patience.of(cfg.evaluation)
    found = persist.find_resume(cfg, resume)
    if found is not None:
        state = persist.restore(found, run, named, optimizer, patience)
        pos, window = Position.restored(state, found[1])
    sinks.start(
        cfg,
        model,
        plan,
        steps,
        data=(train.path, train.describe()),
        held=(held.path, held.describe()) if held is not None else None,
        iterations=corpus.epochs,
        initial_step=pos.global_step,
    )
    if found is not None:
        sinks.resumed(found[1], pos.global_step)

    # 3. train
    opts = LossOptions(
        training.chunked_cross_entropy, training.chunked_ce_tiles, training.chunked_ce_seq_chunk
    )
    # what a client's evaluate measures (run server): the held-out data; offline distillation,
    # which takes no [evaluation], measures the first examples of its own corpus
    probe, limit = (train, PROBE_EXAMPLES) if cfg.run.algorithm == "distill" else (held, None)
    kv = context.kv_dtype(model, training)
    result = SFTResult(Path(cfg.output.path), pos.global_step, pos.epoch, None, False, 0.0, 0)
    for epoch in range(pos.epoch, corpus.epochs):
        order = order_of(train, plan.seed, epoch, corpus.shuffle)
        start_index = pos.index if epoch == pos.epoch else 0
        for i in range(start_index, len(order)):
            example = train.examples[order[i]]
            groups = groups_of(example, training.micro_batch, training.gradient_accumulation)
            first = pos.group if (epoch, i) == (pos.epoch, pos.index) else 0
            if first:  # inside a window: its earlier passes' keys and values, as they were
                cache = restore_window(window, model.decoder, example, kv, groups[first - 1].end)
            else:
                cache = new_cache(model.decoder, example, kv)
            for g in range(first, len(groups)):
                t0 = time.perf_counter()
                mine = set(distributed.share(len(groups[g].passes)))
                loss = backward_group(
                    model.decoder,
                    example,
                    groups[g],
                    cache,
                    opts,
                    corpus.pass_loss(order[i]),
                    mine,
                )
                (loss,) = replicas.sum_step(params, loss)
                lr = lr_at(
                    pos.global_step, steps, rate, training.lr_scheduler, training.warmup_steps
                )
                checked_step(
                    params,
                    optimizer,
                    training.max_grad_norm,
                    lr,
                    loss,
                    f"step {pos.global_step + 1} ({example.where})",
                )
                pos = _advance(pos, epoch, i, g, len(groups), len(order))
                tokens = sum(e - s for s, e in groups[g].passes)
                result.tokens += tokens
                result.last_loss = loss
                seconds = time.perf_counter() - t0
                values = {names.TRAIN_LOSS: loss, names.LEARNING_RATE: lr}
                sinks.step(pos.global_step, epoch, values, tokens, seconds)
                cfg, rate = persist.boundary(
                    sinks, cfg, patience, lambda cfg=cfg: _measure(cfg, model, probe, limit)
                )
                log.debug(
                    "step %d (%s, group %d/%d): %d tokens, loss %.4f, lr %.3g, %.3f s",
                    pos.global_step,
                    example.where,
                    g + 1,
                    len(groups),
                    tokens,
                    loss,
                    lr,
                    seconds,
                )
                # 4. evaluate after an epoch's last step, before that step's checkpoint
                if pos.epoch == epoch + 1:
                    result.epochs_done = epoch + 1
                    if held is not None and epoch_evaluation_due(cfg, epoch):
                        _evaluate(cfg, model, held, pos, patience, result, sinks)
                        if result.last_eval_improved:
                            persist.save_best(
                                cfg, run, pos.mark(), named, optimizer, plan, patience, steps, sinks
                            )
                end = groups[g].end
                window = (lambda c=cache, e=end: window_bytes(c, e)) if pos.group else None
                persist.maybe_checkpoint(
                    cfg, run, pos.mark(window), named, optimizer, plan, patience, steps, sinks
                )
        if patience.stop:
            result.stopped_early = True
            break
    # 5. export; if that fails, the trained adapter is kept elsewhere and the error says where
    persist.export_or_keep(
        cfg, model, run_file, run, pos.mark(), named, optimizer, plan, trained, patience, steps
    )
    result.global_step = pos.global_step
    result.best_eval = patience.best if patience.best != float("inf") else None
    result.seconds = time.perf_counter() - started
    sinks.finish(
        {
            cfg.output.kind or "adapter": str(result.output),
            "epochs": result.epochs_done,
            "stopped early": "yes (patience)" if result.stopped_early else "no",
        }
    )
    return result


def _advance(pos: Position, epoch: int, i: int, g: int, n_groups: int, n_examples: int) -> Position:
    """The position after group g of example i: the next group, example or epoch."""
    step = pos.global_step + 1
    if g + 1 < n_groups:
        return Position(epoch, i, g + 1, step)
    if i + 1 < n_examples:
        return Position(epoch, i + 1, 0, step)
    return Position(epoch + 1, 0, 0, step)


def _measure(cfg, model, data: SFTDataset | None, limit: int | None = None) -> dict | None:
    """Loss and perplexity on `data`'s trained tokens with the weights as they are (None
    without data), one process (a client's question to a served run); patience is not told."""
    if data is None:
        return None
    t = cfg.training
    loss, _ = sft_loss(
        model.decoder,
        data,
        limit,
        seq_chunk=t.chunked_ce_seq_chunk,
        chunked=t.chunked_cross_entropy,
        tiles=t.chunked_ce_tiles,
    )
    examples = len(data.examples[:limit])
    return {"examples": examples, "loss": loss, "perplexity": perplexity(loss)}


def _evaluate(
    cfg, model, held, pos: Position, patience: Patience, result: SFTResult, sinks
) -> None:
    t0 = time.perf_counter()
    t = cfg.training
    # each rank its block of the held-out set; under fsdp2 all of it (passes are collectives)
    sharded = model.decoder.sharded
    mine = range(len(held.examples)) if sharded else distributed.share(len(held.examples))
    loss, count = sft_loss(
        model.decoder,
        dataclasses.replace(held, examples=tuple(held.examples[k] for k in mine)),
        seq_chunk=t.chunked_ce_seq_chunk,
        chunked=t.chunked_cross_entropy,
        tiles=t.chunked_ce_tiles,
    )
    if distributed.world().active and not sharded:
        total, count = distributed.all_reduce_sum([loss * count if count else 0.0, count])
        loss = total / count if count else float("nan")
    log.info(
        "evaluation at step %d: loss %.4f in %.2f s",
        pos.global_step,
        loss,
        time.perf_counter() - t0,
    )
    result.last_eval_improved = patience.update(loss)
    result.evals.append((pos.global_step, loss))
    sinks.evaluation(
        pos.global_step,
        {names.EVAL_LOSS: loss, names.EVAL_PERPLEXITY: perplexity(loss)},
        result.last_eval_improved,
    )
