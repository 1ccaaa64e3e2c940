"""Preference optimisation of a LoRA adapter on chosen/rejected pairs: dpo, ipo, simpo, orpo.

Phases: 1. build (pairs read, tokenized and checked before the model loads), open the run
(model, plan, optimizer, resume: frame.py)  2. reference scores (dpo, ipo)  3. a step: the
next pairs scored in passes (pairs.py), backward, the checked optimizer step  4. the
logps_drop_warn warning  5. report, evaluate after an epoch's last step, checkpoint, stop early
(frame.after_step)  6. export (frame.finish). The losses are pure functions (losses/preference.py
says their formulas and variants). Where
this loop departs from a textbook trainer, or decides what the spec leaves open:
- a step takes the next pairs of the epoch's order: `pairs_per_step` of them (fewer at the
  epoch's end), or, left out, as many as fit one optimizer window of micro_batch x
  gradient_accumulation = ctx tokens (a pair's tokens count its prompt once), at least one;
- a pass holds whole pairs within micro_batch tokens, at least one pair (which may exceed it):
  a pair whose prompt and both answers fit is scored after one pass over its prompt
  (shared_prefix_fanout auto; max or 2 require it of every pair); the rest go as two rows each,
  several pairs' rows in one pass where they fit. Each pass's loss is its pairs' losses over
  the step's pair count, so the passes' gradients add up to the whole step's;
- reference scores (dpo, ipo) are computed once per pair, before the first step and without
  gradient: `initial` is the adapter as the run starts (base + init_adapter), `base` the
  adapters off, or [reference].model, which is loaded only for that. They are kept in every
  checkpoint (preference-reference.bin) and never recomputed: a resumed run reads them back;
- the epoch's order is a pure function of ([lora].seed, epoch), so resume needs no RNG state;
- logps_drop_warn compares each pair's log-probabilities with their first value: the initial
  policy's when the reference is `initial`, else the first time the run scored the pair.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms import context, frame, pairs
from retrograd.algorithms.evaluate import Evaluation
from retrograd.algorithms.pairs import FIRST, REFERENCE, PairStats, Scored, Scores, shared_tokens
from retrograd.data.pairs import TokenPair, read_pairs, tokenize_pairs
from retrograd.data.sft import permutation
from retrograd.errors import CheckpointError, ConfigError, DataError
from retrograd.losses.preference import (
    NEEDS_REFERENCE,
    PreferenceLossOut,
    dpo_loss,
    ipo_loss,
    orpo_loss,
    simpo_loss,
)
from retrograd.observe import names

log = logging.getLogger(__name__)
_NOT_TRAJECTORY = {"data", "logps_drop_warn"}  # [preference] keys that change no step
SCORES = ("chosen", "rejected")  # Scored's fields, as the losses take them
REFERENCED = (*SCORES, "ref_chosen", "ref_rejected")
TOKENS = ("chosen_tokens", "rejected_tokens")


def check_available(cfg) -> None:
    """[training].shared_prefix_fanout as pairs read it: a pair has two answers."""
    fanout = cfg.training.shared_prefix_fanout
    if isinstance(fanout, int) and fanout > 2:
        raise ConfigError(
            f"[training].shared_prefix_fanout = {fanout}: a preference pair packs its two "
            "answers after one prompt pass; use auto, off, max or 2"
        )


def load_pairs(cfg, chat) -> tuple[list[TokenPair], list[TokenPair] | None, dict]:
    """Training and held-out pairs as ids, every rule checked (DataError naming file:line),
    and the files' fingerprints."""
    t = cfg.training
    files = {"train": read_pairs(cfg.preference.data, "[preference].data")}
    if cfg.evaluation is not None:
        files["eval"] = read_pairs(cfg.evaluation.data, "[evaluation].data")
    sets = {k: tokenize_pairs(f, chat, t.ctx) for k, f in files.items()}
    if t.shared_prefix_fanout not in ("auto", "off"):  # max, 2: every pair shares its prompt
        for p in (p for s in sets.values() for p in s):
            if shared_tokens(p) > t.micro_batch:
                raise DataError(
                    f"{p.key}: its shared-prompt pass takes {shared_tokens(p)} tokens, more "
                    f"than [training].micro_batch = {t.micro_batch}, and shared_prefix_fanout "
                    f"= {t.shared_prefix_fanout!r} requires one; raise micro_batch or use auto"
                )
    prints = {k: f.fingerprint for k, f in files.items()}
    return sets["train"], sets.get("eval"), prints


def order_of(n: int, cfg, epoch: int) -> np.ndarray:
    seed = context.shuffle_seed(cfg)
    return permutation(n, seed, epoch) if cfg.preference.shuffle else np.arange(n)


def steps_of(pairs: list[TokenPair], order: np.ndarray, cfg) -> list[tuple[int, int]]:
    """The epoch's optimizer steps as [start, end) ranges of its order (module docstring)."""
    per, budget = cfg.preference.pairs_per_step, cfg.training.ctx
    out, start, tokens = [], 0, 0
    for i, j in enumerate(order):
        n = pairs[j].n_tokens
        full = i - start >= per if per else i > start and tokens + n > budget
        if full:
            out.append((start, i))
            start, tokens = i, 0
        tokens += n
    return out + [(start, len(order))]


def total_steps(pairs: list[TokenPair], cfg) -> int:
    return sum(
        len(steps_of(pairs, order_of(len(pairs), cfg, e), cfg)) for e in range(cfg.training.epochs)
    )


def run_preference(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    p, t = cfg.preference, cfg.training
    # 1. build: the pairs are tokenized and checked with the file's own tokenizer and template
    check_available(cfg)
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    train, held, prints = load_pairs(cfg, context.file_chat_format(cfg.model.path))
    model = frame.model_of(cfg, door)
    loss_fn = loss_of(p)
    settings = {
        "preference": p.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        "shared_prefix_fanout": t.shared_prefix_fanout,
        "reference_model": context.reference_id(cfg),
    }
    held_path = Path(cfg.evaluation.data) if held else None
    inputs = frame.Inputs(
        prints,
        settings,
        (Path(p.data), describe(Path(p.data), train)),
        (held_path, describe(held_path, held)) if held else None,
    )
    label = "loss, first -> last step"
    steps = total_steps(train, cfg)
    shape = frame.Shape(steps, t.epochs, "step", names.TRAIN_LOSS, label, "no step ran")
    run = frame.open_run(cfg, model, door, inputs, shape)
    # 2. reference scores: once per pair, before the first step (a checkpoint keeps them)
    ref, first = _scores(run, train, held)
    sharded = run.replicas.sharded
    run = frame.evaluate_with(run, _evaluation(model, held, ref, loss_fn, sharded))
    artifacts = {FIRST: lambda: pairs.encode_scores(FIRST, [first])}
    if ref is not None:
        artifacts[REFERENCE] = lambda: pairs.encode_scores(REFERENCE, [ref["train"], ref["eval"]])
    pos, train_ref = run.position, ref["train"] if ref else None
    warned = bool(pos.extra.get("warned", False))
    with run.closing:
        for epoch, order, start, end in _steps(run, train):
            began, before = time.perf_counter(), pos.global_step
            # 3. the step's pairs: each rank its passes, the ranks' gradients summed
            members = [int(j) for j in order[start:end]]
            stats = pairs.score_pairs(
                model.decoder,
                train,
                members,
                run.cfg,
                train_ref,
                loss_fn,
                train=True,
                sharded=sharded,
            )
            run.replicas.sum_step(run.tr.params)
            where = f"step {before + 1} ({train[members[0]].key}, {len(members)} pairs)"
            rate, _ = frame.optimizer_step(run, before, stats.loss, where)
            # 4. logps_drop_warn, once
            if not warned:
                warning = drop_warning(p.logps_drop_warn, first, members, stats)
                if warning is not None:
                    warned = True
                    run.result.warnings.append(f"step {before + 1}: {warning}")
                    door.sinks.warn(run.result.warnings[-1])
            # 5. report, evaluate after an epoch's last step, checkpoint
            last = end == len(order)
            pos = frame.Position(
                before + 1, epoch + last, 0, 0 if last else end, {}, {"warned": warned}
            )
            values = {**stats.values(), names.LEARNING_RATE: rate}
            tokens = sum(train[j].n_tokens for j in members)
            report = frame.Report(
                values, tokens, began, epoch, before, iteration_done=last, artifacts=artifacts
            )
            if frame.after_step(run, pos, report):
                break
    # 6. export; if that fails, the trained result is kept elsewhere and the error says where
    return frame.finish(run, pos, artifacts=artifacts)


def _steps(run: frame.Run, train: list[TokenPair]) -> Iterator[tuple[int, np.ndarray, int, int]]:
    """(epoch, its order, start, end) of each step from the run's position on."""
    cfg, pos = run.cfg, run.position
    for epoch in range(pos.epoch, cfg.training.epochs):
        order = order_of(len(train), cfg, epoch)
        for start, end in steps_of(train, order, cfg):
            if epoch == pos.epoch and start < pos.index:
                continue  # done before the checkpoint this run resumed from
            yield epoch, order, start, end


def _scores(run: frame.Run, train, held) -> tuple[dict[str, Scores] | None, Scores]:
    """The reference scores (dpo, ipo) and each pair's first scores: a checkpoint's, or
    computed now, before the first step."""
    cfg, p = run.cfg, run.cfg.preference
    if run.restored is not None:
        return _restored_scores(run.restored.artifacts, p.loss, len(train), run.source)
    first = Scores.unset(len(train))
    if not NEEDS_REFERENCE[p.loss]:
        return None, first
    t0, n, sinks = time.perf_counter(), len(train) + len(held or []), run.door.sinks
    sinks.note(f"reference scores of {n} pairs (once, before the first step) ...")
    sets = {"train": train, "eval": held or []}
    ref = pairs.reference_scores(cfg, run.model, run.tr.adapters, sets, run.replicas.sharded)
    sinks.note(f"reference scores of {n} pairs in {time.perf_counter() - t0:.1f} s")
    if (p.reference or "initial") == "initial" and cfg.reference is None:
        first = Scores(ref["train"].chosen.copy(), ref["train"].rejected.copy())
    return ref, first


def describe(path: Path, pairs: list[TokenPair]) -> str:
    tokens = sum(x.n_tokens for x in pairs)
    return f"{path.name}: {len(pairs)} pairs, {tokens:,} tokens"


# [preference].loss -> its function (losses/preference.py), the Scored fields it takes in
# order, and the section keys it takes besides beta
LOSSES = {
    "dpo": (dpo_loss, REFERENCED, ("label_smoothing",)),
    "ipo": (ipo_loss, (*REFERENCED, *TOKENS), ()),
    "simpo": (simpo_loss, (*SCORES, *TOKENS), ("gamma_beta_ratio",)),
    "orpo": (orpo_loss, (*SCORES, *TOKENS), ()),
}


def loss_of(section) -> Callable[[Scored, float], PreferenceLossOut]:
    """[preference].loss as a function of a piece's scores and the step's pair count."""
    fn, fields, keys = LOSSES[section.loss]
    options = {k: getattr(section, k) for k in keys}

    def loss(s: Scored, n: float) -> PreferenceLossOut:
        args = (getattr(s, f) for f in fields)
        return fn(*args, beta=section.effective_beta, normalizer=n, **options)

    return loss


def _restored_scores(artifacts, loss: str, n: int, source: str):
    """(reference scores or None, first scores) a checkpoint keeps."""
    ref = None
    if NEEDS_REFERENCE[loss]:
        if REFERENCE not in artifacts:
            raise CheckpointError(
                f"cannot resume from {source}: it holds no {REFERENCE}, the reference scores "
                f"a {loss} run computed before its first step"
            )
        train, held = pairs.decode_scores(REFERENCE, artifacts[REFERENCE], source)
        ref = {"train": train, "eval": held}
    (first,) = pairs.decode_scores(FIRST, artifacts[FIRST], source)
    assert len(first.chosen) == n, (len(first.chosen), n)  # the data fingerprint matched
    return ref, first


# -- logps_drop_warn -----------------------------------------------------------------------


def drop_warning(limit: float, first: Scores, members: list[int], stats: PairStats) -> str | None:
    """The warning when the step's chosen answers lost more than `limit` nats on average since
    their first scores while the rejected ones lost too; records first scores it lacked."""
    idx = np.asarray(stats.members)
    chosen, rejected = stats.columns["chosen_logps"], stats.columns["rejected_logps"]
    unset = np.isnan(first.chosen[idx])
    first.chosen[idx[unset]] = chosen[unset]
    first.rejected[idx[unset]] = rejected[unset]
    lost_c = float(np.mean(first.chosen[idx] - chosen))
    lost_r = float(np.mean(first.rejected[idx] - rejected))
    if lost_c <= limit or lost_r <= 0:
        return None
    return (
        f"the chosen answers lost {lost_c:.2f} nats of log-probability on average since first "
        f"scored, the rejected ones {lost_r:.2f}: both fall, more than [preference]."
        f"logps_drop_warn = {limit} (the adapter unlearns the chosen answers too; a lower lr "
        "or beta, or orpo's NLL term, holds them)"
    )


# -- evaluation ----------------------------------------------------------------------------


def _evaluation(model, held, ref, loss_fn, sharded: bool) -> Evaluation:
    """The held-out pairs' loss and statistics (patience reads eval/preference_loss; `sharded`:
    the run's Replicas.sharded); a client's evaluate: their loss and reward accuracy."""
    refs = ref["eval"] if ref else None

    @torch.no_grad()
    def stats(cfg) -> PairStats:
        members = list(range(len(held)))
        return pairs.score_pairs(
            model.decoder, held, members, cfg, refs, loss_fn, train=False, sharded=sharded
        )

    def measure(cfg) -> dict:
        values = stats(cfg).values(eval_names=True)
        loss, accuracy = values[names.EVAL_PREFERENCE_LOSS], values[names.EVAL_ACCURACY]
        return {"examples": len(held), "loss": loss, "accuracy": accuracy}

    if not held:
        return Evaluation(None, measure=lambda cfg: None)
    scheduled = lambda cfg: stats(cfg).values(eval_names=True)  # noqa: E731
    return Evaluation(scheduled, names.EVAL_PREFERENCE_LOSS, measure=measure)
