"""Preference optimisation of a LoRA adapter on chosen/rejected pairs: dpo, ipo, simpo, orpo.

Phases: 1. build (pairs read, tokenized and checked before the model loads; model, plan,
optimizer)  2. resume  3. reference scores (dpo, ipo)  4. train (steps of pairs, metrics, the
logps_drop_warn warning, checkpoints)  5. evaluate after an epoch, stop early  6. export.
The losses are pure functions (losses/preference.py says their formulas and variants). Where
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

import contextlib
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd import distributed
from retrograd.algorithms import context, frame, persist
from retrograd.algorithms.evaluate import Patience, epoch_evaluation_due
from retrograd.algorithms.step import checked_step
from retrograd.checkpoint import DatasetPosition, outputs
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
from retrograd.model.logprobs import sequence_logprobs, shared_prefix_logprobs
from retrograd.observe import names
from retrograd.optim import lr_at

log = logging.getLogger(__name__)
REFERENCE = "preference-reference.bin"  # artifact: reference scores (formats.md §5.1)
FIRST = "preference-first.bin"  # artifact: each pair's first scores (logps_drop_warn)
MAGICS = {REFERENCE: b"RGPREFRF", FIRST: b"RGPREFFS"}
_NOT_TRAJECTORY = {"data", "logps_drop_warn"}  # [preference] keys that change no step


@dataclass
class Position:
    """Where the loop is between two steps: resume continues from exactly here."""

    epoch: int = 0
    index: int = 0  # the next step's first pair, in the epoch's order
    global_step: int = 0
    warned: bool = False  # logps_drop_warn said so once

    def mark(self, artifacts: dict) -> persist.Mark:
        return persist.Mark(
            self.global_step,
            epoch=self.epoch,
            dataset=DatasetPosition(self.epoch, self.index),
            extra={"warned": self.warned},
            artifacts=artifacts,
        )

    @classmethod
    def restored(cls, state) -> Position:
        ds = state.dataset
        return cls(ds.epoch, ds.index, state.global_step, bool(state.progress.extra["warned"]))


@dataclass
class Scores:
    """Summed log-probabilities of each pair's written tokens, float32 (N,) each."""

    chosen: np.ndarray
    rejected: np.ndarray

    @classmethod
    def unset(cls, n: int) -> Scores:
        return cls(np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32))


@dataclass
class PreferenceResult:
    output: Path
    global_step: int
    epochs_done: int
    best_eval: float | None
    stopped_early: bool
    seconds: float
    losses: list[float] = field(default_factory=list)  # each step's loss
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


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


def run_preference(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> PreferenceResult:
    door = frame.door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    resume, run_file, sinks = door.resume, door.run_file, persist.Legacy(door)
    started = time.perf_counter()
    p, t = cfg.preference, cfg.training
    # 1. build: the pairs are tokenized and checked with the file's own tokenizer and template
    check_available(cfg)
    outputs.check_outputs(cfg, run_file)
    pairs, held, prints = load_pairs(cfg, context.file_chat_format(cfg.model.path))
    model = context.load_model(cfg)
    context.preflight_check(model, t, getattr(sinks, "console", None))
    context.apply_memory_knobs(model, t)
    tr = context.trainables(model, cfg)
    plan, adapters, named, params, optimizer = (
        tr.plan,
        tr.adapters,
        tr.named,
        tr.params,
        tr.optimizer,
    )
    rate, steps = tr.rate, total_steps(pairs, cfg)
    loss_fn = loss_of(p)
    # under torchrun each rank scores its share of every step's pieces (docs/distributed.md)
    replicas = distributed.wrap_trainable(model, tr)
    settings = {
        "preference": p.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        "shared_prefix_fanout": t.shared_prefix_fanout,
        "reference_model": context.reference_id(cfg),
    }
    run = persist.RunIdentity.of(cfg, model.config.name, prints, plan, settings)

    # 2. resume: weights, optimizer, position, and the scores a checkpoint keeps
    pos = Position()
    patience = Patience.of(cfg.evaluation)
    ref: dict[str, Scores] | None = None
    first = Scores.unset(len(pairs))
    found = persist.find_resume(cfg, resume)
    if found is not None:
        state = persist.restore(found, run, named, optimizer, patience)
        pos = Position.restored(state)
        ref, first = _restored_scores(state.artifacts, p.loss, len(pairs), found[1])
    sinks.start(
        cfg,
        model,
        plan,
        steps,
        data=(Path(p.data), describe(Path(p.data), pairs)),
        held=(Path(cfg.evaluation.data), describe(Path(cfg.evaluation.data), held))
        if held
        else None,
        iterations=t.epochs,
        initial_step=pos.global_step,
    )
    if found is not None:
        sinks.resumed(found[1], pos.global_step)
    # 3. reference scores: once per pair, before the first step
    if ref is None and NEEDS_REFERENCE[p.loss]:
        t0 = time.perf_counter()
        n = len(pairs) + len(held or [])
        sinks.note(f"reference scores of {n} pairs (once, before the first step) ...")
        ref = reference_scores(cfg, model, adapters, {"train": pairs, "eval": held or []})
        sinks.note(f"reference scores of {n} pairs in {time.perf_counter() - t0:.1f} s")
        if (p.reference or "initial") == "initial" and cfg.reference is None:
            first = Scores(ref["train"].chosen.copy(), ref["train"].rejected.copy())

    def mark() -> persist.Mark:
        arts = {FIRST: lambda: encode_scores(FIRST, [first])}
        if ref is not None:
            arts[REFERENCE] = lambda: encode_scores(REFERENCE, [ref["train"], ref["eval"]])
        return pos.mark(arts)

    # 4. train
    result = PreferenceResult(Path(cfg.output.path), pos.global_step, pos.epoch, None, False, 0.0)
    train_ref = ref["train"] if ref else None
    for epoch in range(pos.epoch, t.epochs):
        order = order_of(len(pairs), cfg, epoch)
        for start, end in steps_of(pairs, order, cfg):
            if epoch == pos.epoch and start < pos.index:
                continue  # done before the checkpoint this run resumed from
            t0 = time.perf_counter()
            members = [int(j) for j in order[start:end]]
            lr = lr_at(pos.global_step, steps, rate, t.lr_scheduler, t.warmup_steps)
            stats = score_pairs(model.decoder, pairs, members, cfg, train_ref, loss_fn, train=True)
            replicas.sum_step(params)  # each rank's pieces' gradients: the whole step's
            where = f"step {pos.global_step + 1} ({pairs[members[0]].key}, {len(members)} pairs)"
            checked_step(params, optimizer, t.max_grad_norm, lr, stats.loss, where)
            last = end == len(order)
            pos = Position(epoch + last, 0 if last else end, pos.global_step + 1, pos.warned)
            values = stats.values()
            values[names.LEARNING_RATE] = lr
            if not pos.warned:
                warning = drop_warning(p.logps_drop_warn, first, members, stats)
                if warning is not None:
                    pos.warned = True
                    result.warnings.append(f"step {pos.global_step}: {warning}")
                    sinks.warn(result.warnings[-1])
            tokens = sum(pairs[j].n_tokens for j in members)
            sinks.step(pos.global_step, epoch, values, tokens, time.perf_counter() - t0)
            cfg, rate = persist.boundary(
                sinks, cfg, patience, lambda cfg=cfg: _measure(cfg, model, held, ref, loss_fn)
            )
            result.losses.append(stats.loss)
            # 5. evaluate after an epoch's last step, before that step's checkpoint
            if last:
                result.epochs_done = epoch + 1
                if held and epoch_evaluation_due(cfg, epoch):
                    held_ref = ref["eval"] if ref else None
                    improved, evals = _evaluate(cfg, model, held, held_ref, loss_fn, pos, patience)
                    result.evals.append((pos.global_step, evals))
                    sinks.evaluation(pos.global_step, evals, improved)
                    if improved:
                        persist.save_best(
                            cfg, run, mark(), named, optimizer, plan, patience, steps, sinks
                        )
            persist.maybe_checkpoint(
                cfg, run, mark(), named, optimizer, plan, patience, steps, sinks
            )
        if patience.stop:
            result.stopped_early = True
            break
    # 6. export; if that fails, the trained adapter is kept elsewhere and the error says where
    persist.export_or_keep(
        cfg, model, run_file, run, mark(), named, optimizer, plan, tr.trained, patience, steps
    )
    result.global_step = pos.global_step
    result.best_eval = patience.best if patience.best != float("inf") else None
    result.seconds = time.perf_counter() - started
    sinks.finish(
        {
            "adapter": str(result.output),
            "epochs": result.epochs_done,
            "loss, first -> last step": _first_last(result.losses),
            "stopped early": "yes (patience)" if result.stopped_early else "no",
        }
    )
    return result


def describe(path: Path, pairs: list[TokenPair]) -> str:
    tokens = sum(x.n_tokens for x in pairs)
    return f"{path.name}: {len(pairs)} pairs, {tokens:,} tokens"


# -- scoring: passes of whole pairs ----------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Pairs scored in one forward: one pair after a pass over its prompt (shared), or rows
    prompt + answer, two a pair."""

    pairs: tuple[int, ...]
    shared: bool


def shared_tokens(p: TokenPair) -> int:
    """Tokens of a pair's shared-prompt passes: the prompt, then both answers padded."""
    return len(p.prompt) + 2 * max(len(p.chosen), len(p.rejected))


def pieces_of(pairs: list[TokenPair], members: list[int], budget: int, fanout) -> list[Piece]:
    """The passes over `members`: whole pairs within `budget` tokens, one pair at least."""
    out, rows, width = [], [], 0
    for i in members:
        p = pairs[i]
        if fanout not in ("auto", "off") or (fanout == "auto" and shared_tokens(p) <= budget):
            out.append(Piece((i,), True))
            continue
        w = len(p.prompt) + max(len(p.chosen), len(p.rejected))
        if rows and max(width, w) * 2 * (len(rows) + 1) > budget:
            out.append(Piece(tuple(rows), False))
            rows, width = [], 0
        rows.append(i)
        width = max(width, w)
    return out + ([Piece(tuple(rows), False)] if rows else [])


def score(decoder, pairs: list[TokenPair], piece: Piece, training) -> tuple[torch.Tensor, ...]:
    """(chosen, rejected) (P,) float32: each pair's summed log-probability of its answers'
    written tokens, differentiable under grad."""
    opts = {
        "chunked": training.chunked_cross_entropy,
        "tiles": training.chunked_ce_tiles,
        "seq_chunk": training.chunked_ce_seq_chunk,
    }
    ps = [pairs[i] for i in piece.pairs]
    if piece.shared:
        (p,) = ps
        answers = [list(p.chosen), list(p.rejected)]
        lps = shared_prefix_logprobs(decoder, list(p.prompt), answers, **opts)
    else:
        rows = [
            (list(p.prompt) + list(a), len(p.prompt)) for p in ps for a in (p.chosen, p.rejected)
        ]
        lps = sequence_logprobs(decoder, rows, **opts)
    masks = [m for p in ps for m in (p.chosen_mask, p.rejected_mask)]
    keep = [torch.tensor(m, dtype=torch.bool, device=lps[0].device) for m in masks]
    sums = torch.stack([lp[k].sum() for lp, k in zip(lps, keep, strict=True)])  # (2P,)
    return sums[0::2], sums[1::2]


@dataclass(frozen=True)
class Scored:
    """What a loss reads of a piece's pairs, (P,) each; ref_* None without a reference."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def loss_of(section) -> Callable[[Scored, float], PreferenceLossOut]:
    """[preference].loss as a function of a piece's scores and the step's pair count."""
    b = section.effective_beta
    table = {
        "dpo": lambda s, n: dpo_loss(
            s.chosen,
            s.rejected,
            s.ref_chosen,
            s.ref_rejected,
            beta=b,
            label_smoothing=section.label_smoothing,
            normalizer=n,
        ),
        "ipo": lambda s, n: ipo_loss(
            s.chosen,
            s.rejected,
            s.ref_chosen,
            s.ref_rejected,
            s.chosen_tokens,
            s.rejected_tokens,
            beta=b,
            normalizer=n,
        ),
        "simpo": lambda s, n: simpo_loss(
            s.chosen,
            s.rejected,
            s.chosen_tokens,
            s.rejected_tokens,
            beta=b,
            gamma_beta_ratio=section.gamma_beta_ratio,
            normalizer=n,
        ),
        "orpo": lambda s, n: orpo_loss(
            s.chosen, s.rejected, s.chosen_tokens, s.rejected_tokens, beta=b, normalizer=n
        ),
    }
    return table[section.loss]


@dataclass(frozen=True)
class PairStats:
    """The per-pair statistics of a step or an evaluation, by pair index."""

    members: list[int]  # sorted
    columns: dict[str, np.ndarray]  # float64 (P,) per statistic

    @property
    def loss(self) -> float:
        return float(self.columns["loss"].mean())

    def values(self, eval_names: bool = False) -> dict[str, float]:
        """Means over the pairs, by metric name (observe/names.py)."""
        table = EVAL_NAMES if eval_names else STEP_NAMES
        out = {
            name: float(self.columns[k].mean()) for k, name in table.items() if k in self.columns
        }
        if not eval_names:
            out[names.TRAIN_LOSS] = self.loss
            out[names.PREFERENCE_PAIRS_PER_STEP] = float(len(self.members))
        return out


STEP_NAMES = {
    "loss": names.PREFERENCE_LOSS,
    "accuracy": names.PREFERENCE_ACCURACY,
    "margin": names.PREFERENCE_MARGIN,
    "chosen_reward": names.PREFERENCE_CHOSEN_REWARD,
    "rejected_reward": names.PREFERENCE_REJECTED_REWARD,
    "chosen_logps": names.PREFERENCE_CHOSEN_LOGPS,
    "rejected_logps": names.PREFERENCE_REJECTED_LOGPS,
    "nll": names.PREFERENCE_NLL,
    "log_odds": names.PREFERENCE_LOG_ODDS,
    "orpo_clamped": names.PREFERENCE_ORPO_CLAMPED,
}
EVAL_NAMES = {
    "loss": names.EVAL_PREFERENCE_LOSS,
    "accuracy": names.EVAL_ACCURACY,
    "margin": names.EVAL_MARGIN,
    "chosen_logps": names.EVAL_CHOSEN_LOGPS,
    "rejected_logps": names.EVAL_REJECTED_LOGPS,
}


def score_pairs(
    decoder, pairs, members: list[int], cfg, ref: Scores | None, loss_fn, *, train: bool
) -> PairStats:
    """Each pass's loss over len(members) pairs, backward when training: the passes'
    gradients sum to the gradient of the mean loss over `members`. Under torchrun each rank
    runs its share of the passes; the statistics of all of them come back on every rank.
    Under fsdp2 every rank runs every pass (each gathers the sharded blocks, a collective every
    rank joins) and back-propagates the others' with a zero loss."""
    t = cfg.training
    parts: dict[str, list[np.ndarray]] = {}
    order: list[int] = []
    for piece, own in _passes(
        decoder, pieces_of(pairs, members, t.micro_batch, t.shared_prefix_fanout)
    ):
        chosen, rejected = score(decoder, pairs, piece, t)
        out = loss_fn(_scored(pairs, piece, chosen, rejected, ref), len(members))
        if train:
            (out.loss if own else out.loss * 0.0).backward()
        order += piece.pairs
        for k, v in _columns(out).items():
            parts.setdefault(k, []).append(v)
    if distributed.world().active and not decoder.sharded:  # every rank's pieces, rank order
        shares = distributed.gather_objects((order, parts))
        order = [i for o, _ in shares for i in o]
        parts = {k: [v for _, p in shares for v in p.get(k, [])] for k in shares[0][1]}
    back = np.argsort(order)  # pieces regroup pairs: put them back in `members` order
    columns = {k: np.concatenate(v)[back] for k, v in parts.items()}
    return PairStats(sorted(members), columns)


def _passes(decoder, pieces: list[Piece]) -> list[tuple[Piece, bool]]:
    """The pieces this rank runs, each with whether it is its own: its block of them (all of
    them in one process), or under fsdp2 (blocks sharded) every piece in order, the ranks'
    forwards and backwards in step."""
    mine = set(distributed.share(len(pieces)))
    return [(p, k in mine) for k, p in enumerate(pieces) if decoder.sharded or k in mine]


def _scored(pairs, piece: Piece, chosen, rejected, ref: Scores | None) -> Scored:
    dev, idx = chosen.device, list(piece.pairs)

    def tensor(values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.float32), device=dev)

    return Scored(
        chosen,
        rejected,
        tensor(ref.chosen[idx]) if ref is not None else None,
        tensor(ref.rejected[idx]) if ref is not None else None,
        tensor([sum(pairs[i].chosen_mask) for i in idx]),
        tensor([sum(pairs[i].rejected_mask) for i in idx]),
    )


def _columns(out: PreferenceLossOut) -> dict[str, np.ndarray]:
    cols = {
        "loss": out.losses,
        "accuracy": out.accuracy,
        "margin": out.margin,
        "chosen_reward": out.chosen_reward,
        "rejected_reward": out.rejected_reward,
        "chosen_logps": out.chosen_logps,
        "rejected_logps": out.rejected_logps,
        "nll": out.nll,
        "log_odds": out.log_odds,
        "orpo_clamped": out.orpo_clamped,
    }
    return {k: v.detach().double().cpu().numpy() for k, v in cols.items() if v is not None}


# -- the reference -------------------------------------------------------------------------


def _reference_context(cfg, model, adapters):
    """initial: the policy as the run starts; base: its adapters off; or [reference].model."""
    if cfg.reference is None and (cfg.preference.reference or "initial") == "initial":
        return lambda: contextlib.nullcontext(None)
    return context.reference(cfg, model, adapters)


@torch.no_grad()
def reference_scores(cfg, model, adapters, sets: dict[str, list[TokenPair]]) -> dict[str, Scores]:
    """Each set's reference scores, by the passes training uses."""
    reference = _reference_context(cfg, model, adapters)
    out = {}
    with reference() as decoder:
        scorer = decoder or model.decoder  # a [reference].model is whole on every rank
        for name, pairs in sets.items():
            scores = Scores.unset(len(pairs))
            members = list(range(len(pairs)))
            fanout = cfg.training.shared_prefix_fanout
            found = []
            pieces = pieces_of(pairs, members, cfg.training.micro_batch, fanout)
            for piece, _own in _passes(scorer, pieces):
                chosen, rejected = score(scorer, pairs, piece, cfg.training)
                found.append(
                    (piece.pairs, chosen.float().cpu().numpy(), rejected.float().cpu().numpy())
                )
            shares = [found] if scorer.sharded else distributed.gather_objects(found)
            for idx, chosen, rejected in (f for s in shares for f in s):
                scores.chosen[list(idx)], scores.rejected[list(idx)] = chosen, rejected
            out[name] = scores
    return out


def encode_scores(name: str, sets: list[Scores]) -> bytes:
    """MAGIC, version 1, the number of sets, each set's length (u32 LE), then each set's
    chosen and rejected scores as float32 LE."""
    head = MAGICS[name] + struct.pack("<II", 1, len(sets))
    head += b"".join(struct.pack("<I", len(s.chosen)) for s in sets)
    body = b"".join(a.astype("<f4").tobytes() for s in sets for a in (s.chosen, s.rejected))
    return head + body


def decode_scores(name: str, data: bytes, source: str) -> list[Scores]:
    magic = MAGICS[name]
    if data[:8] != magic or struct.unpack_from("<I", data, 8)[0] != 1:
        raise CheckpointError(f"{source}: {name} is not a version 1 {magic.decode()} file")
    (count,) = struct.unpack_from("<I", data, 12)
    lengths = struct.unpack_from(f"<{count}I", data, 16)
    at, out = 16 + 4 * count, []
    for n in lengths:
        arrays = []
        for _ in range(2):
            arrays.append(np.frombuffer(data, "<f4", n, at).astype(np.float32))
            at += 4 * n
        out.append(Scores(*arrays))
    return out


def _restored_scores(artifacts, loss: str, n: int, source: str):
    """(reference scores or None, first scores) a checkpoint keeps."""
    ref = None
    if NEEDS_REFERENCE[loss]:
        if REFERENCE not in artifacts:
            raise CheckpointError(
                f"cannot resume from {source}: it holds no {REFERENCE}, the reference scores "
                f"a {loss} run computed before its first step"
            )
        train, held = decode_scores(REFERENCE, artifacts[REFERENCE], source)
        ref = {"train": train, "eval": held}
    (first,) = decode_scores(FIRST, artifacts[FIRST], source)
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


@torch.no_grad()
def _measure(cfg, model, held, ref, loss_fn) -> dict | None:
    """The held-out pairs' loss and reward accuracy with the weights as they are (None without
    [evaluation]), for a client's question to a served run; patience is not told."""
    if not held:
        return None
    refs = ref["eval"] if ref else None
    members = list(range(len(held)))
    stats = score_pairs(model.decoder, held, members, cfg, refs, loss_fn, train=False)
    accuracy = stats.values(eval_names=True)[names.EVAL_ACCURACY]
    return {"examples": len(held), "loss": stats.loss, "accuracy": accuracy}


@torch.no_grad()
def _evaluate(cfg, model, held, ref, loss_fn, pos, patience) -> tuple[bool, dict[str, float]]:
    """(improved, eval/* values): the mean loss and statistics over the held-out pairs;
    patience on eval/preference_loss."""
    t0 = time.perf_counter()
    members = list(range(len(held)))
    stats = score_pairs(model.decoder, held, members, cfg, ref, loss_fn, train=False)
    values = stats.values(eval_names=True)
    log.info(
        "evaluation at step %d: loss %.4f, accuracy %.3f in %.2f s",
        pos.global_step,
        stats.loss,
        values[names.EVAL_ACCURACY],
        time.perf_counter() - t0,
    )
    return patience.update(stats.loss), values


def _first_last(values: list[float]) -> str:
    return f"{values[0]:.4f} -> {values[-1]:.4f}" if values else "no step ran"
