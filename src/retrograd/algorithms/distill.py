"""On-policy distillation of a LoRA adapter toward a teacher GGUF (mode = "on_policy"); the
offline top-k mode is algorithms/distill_offline.py, chosen by `run_distill`.

Each update: 1. choose prompts  2. the student samples samples_per_prompt answers each  3. the
teacher scores every sampled token  4. per-token advantages  5. reference scores (with a KL
term)  6. distill_epochs optimizer passes  7. report, evaluate, checkpoint. The variant
(losses/distill.py and losses/policy.py say the formulas):
- a token's advantage is −k_t, k_t = log π_student(x_t) − log p_teacher(x_t), capped at
  ±weight_clip nats: the sampled-token estimate of the reverse KL (Tinker's on-policy
  distillation), so one answer per prompt is enough (no group baseline);
- the student's log-probabilities come from the training path: the first pass of an update
  scores the answers with the weights that sampled them (ratios exactly 1), and fixes the
  advantages; later passes (distill_epochs > 1) clip the ratio to clip_range_low / high;
- the loss is the token mean over the update's trained tokens, plus kl_coefficient times the
  k3 KL toward the reference (the base model with the adapter off, or [reference].model);
- mask_truncated leaves answers cut at max_new_tokens out of the loss;
- the teacher is loaded once beside the student, frozen, its weights dequantized on use as the
  base model's are; it must use the student's tokenizer (checked before training);
- every random choice is a pure function of the seeds and the update (as GRPO): resume needs
  the update, the prompt cursor and the step;
- under torchrun each rank samples a block of the update's prompts, every rank holds all the
  answers, and each scores (teacher, reference) and back-propagates its own; the ranks'
  gradients are summed before each step and the teacher metrics gathered
  (rollout/spread.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms import context, frame, persist
from retrograd.algorithms.frame import Patience
from retrograd.algorithms.step import checked_step
from retrograd.checkpoint import DatasetPosition, outputs
from retrograd.data.prompts import read_prompts, render_prompts
from retrograd.losses.distill import reverse_kl_advantages
from retrograd.losses.policy import policy_loss
from retrograd.observe import names
from retrograd.optim import lr_at
from retrograd.rollout import spread
from retrograd.rollout.passes import fanout, frozen_logprobs, padded, pieces, score
from retrograd.rollout.records import Rollout
from retrograd.rollout.sample import PromptStream, held_out, sample_groups
from retrograd.sampling.backend import in_process
from retrograd.sampling.params import SampleRequest, SamplingParams
from retrograd.seeds import derive_seed

log = logging.getLogger(__name__)
EVALUATE = "evaluate"  # seeds of held-out answers
_NOT_TRAJECTORY = {"prompts"}  # [distill] keys a resumed run may change


def run_distill(cfg, door=None, *, resume=None, sinks=None, run_file=None):
    """[run].algorithm = "distill": the loop of [distill].mode (algorithms/table.py)."""
    from retrograd.algorithms import table

    return table.run(cfg, door, resume=resume, sinks=sinks, run_file=run_file)


@dataclass
class Position:
    """Where the loop is between two updates: resume continues from exactly here."""

    update: int = 0  # completed updates
    cursor: int = 0  # prompts drawn so far
    global_step: int = 0

    def mark(self) -> persist.Mark:
        return persist.Mark(
            self.global_step,
            update=self.update,
            dataset=DatasetPosition(0, self.cursor, {"update": self.update}),
        )

    @classmethod
    def restored(cls, state) -> Position:
        return cls(state.progress.update, state.dataset.index, state.global_step)


@dataclass
class DistillResult:
    output: Path
    updates: int
    global_step: int
    stopped: str | None
    seconds: float
    teacher_kl: list[float] = field(default_factory=list)  # teacher_kl_mean of each update
    evals: list[tuple[int, float]] = field(default_factory=list)
    best_eval: float | None = None


def run_on_policy(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> DistillResult:
    door = frame.door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    resume, run_file, sinks = door.resume, door.run_file, persist.Legacy(door)
    started = time.perf_counter()
    d, training = cfg.distill, cfg.training
    # 1. build: everything that can be checked is checked before the models load
    context.check_fanout(training, "distill")
    outputs.check_outputs(cfg, run_file)
    prompt_file = read_prompts(d.prompts, "[distill].prompts")
    held_file = read_prompts(cfg.evaluation.data, "[evaluation].data") if cfg.evaluation else None
    model = context.load_model(cfg)
    context.preflight_check(model, training, getattr(sinks, "console", None))
    context.apply_memory_knobs(model, training)
    teacher = load_teacher(cfg, model)
    chat = context.chat_format(model)
    prompts = render_prompts(prompt_file, chat, training.ctx)
    held = render_prompts(held_file, chat, training.ctx) if held_file else None
    tr = context.trainables(model, cfg)
    plan, adapters, named, params, optimizer = (
        tr.plan,
        tr.adapters,
        tr.named,
        tr.params,
        tr.optimizer,
    )
    rate, steps = tr.rate, d.updates * d.distill_epochs
    reference = context.reference(cfg, model, adapters) if d.kl_coefficient > 0 else None
    backend = in_process(model, training, _concurrency(cfg))
    world = spread.current_world()
    stream = PromptStream(prompts, d.prompt_order, d.sampling.seed)
    settings = {
        "distill": d.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        "fast_sampling_context": training.fast_sampling_context,
        "reference": context.reference_id(cfg),
        "teacher": _teacher_id(d.teacher_path),
    }
    fingerprints = {
        "prompts": prompt_file.fingerprint,
        "eval": held_file.fingerprint if held_file else None,
    }
    run = persist.RunIdentity.of(cfg, model.config.name, fingerprints, plan, settings)

    # 2. resume
    pos = Position()
    patience = Patience.of(cfg.evaluation)
    found = persist.find_resume(cfg, resume)
    if found is not None:
        pos = Position.restored(persist.restore(found, run, named, optimizer, patience))
    sinks.start(
        cfg,
        model,
        plan,
        d.updates,
        data=(prompt_file.path, f"{prompt_file.path.name}: {len(prompts)} prompts"),
        held=(held_file.path, f"{held_file.path.name}: {len(held)} prompts") if held else None,
        iterations=d.updates,
        initial_step=pos.global_step,
        unit="update",
        initial_position=pos.update,
    )
    if found is not None:
        sinks.resumed(found[1], pos.global_step)
    result = DistillResult(Path(cfg.output.path), pos.update, pos.global_step, None, 0.0)
    teacher_of = lambda: nullcontext(teacher.decoder)  # noqa: E731

    # 3. updates
    for update in range(pos.update + 1, d.updates + 1):
        t0 = time.perf_counter()
        batch = stream.draw(pos.cursor, d.prompts_per_update)
        groups = spread.spread(batch, partial(_sample, cfg, backend, update=update), world)
        lo, hi = spread.block(len(groups), world)  # this rank's groups
        cursor = pos.cursor + d.prompts_per_update
        answers = [r for grp in groups for r in grp.members]
        if d.mask_truncated:
            for r in answers:
                if r.truncated:
                    r.skip_reason = "truncated"
        trained = [r for r in answers if r.eligible]
        own = [r for grp in groups[lo:hi] for r in grp.members if r.eligible]
        values = _answer_metrics(answers)
        values[names.GENERATION_SECONDS] = time.perf_counter() - t0
        before = pos.global_step
        if trained:
            t1 = time.perf_counter()
            lps = frozen_logprobs(teacher_of, model.decoder, own, training)
            for r, lp in zip(own, lps, strict=True):
                r.teacher_logprobs = lp
            if reference is not None:
                refs = frozen_logprobs(reference, model.decoder, own, training)
                for r, lp in zip(own, refs, strict=True):
                    r.ref_logprobs = lp
            values[names.SCORING_SECONDS] = time.perf_counter() - t1
            t1 = time.perf_counter()
            for _ in range(d.distill_epochs):
                lr = lr_at(
                    pos.global_step, steps, rate, training.lr_scheduler, training.warmup_steps
                )
                out = _epoch(cfg, model.decoder, own, trained, world)
                spread.sum_gradients(params, world)
                checked_step(
                    params,
                    optimizer,
                    training.max_grad_norm,
                    lr,
                    out[names.TOTAL_LOSS],
                    f"update {update}",
                )
                pos.global_step += 1
                backend.policy_changed(pos.global_step)
                values.update(out)
                values[names.LEARNING_RATE] = lr
            values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
            pairs = spread.everyone([(r.old_logprobs, r.teacher_logprobs) for r in own], world)
            values.update(_teacher_metrics(pairs, d.weight_clip))
        for r in answers:
            r.trained = r.eligible and bool(trained)
        pos = Position(update, cursor, pos.global_step)
        tokens = sum(r.n_tokens for r in answers)
        epoch = max(cursor - 1, 0) // len(stream.prompts) + 1
        sinks.step(
            pos.global_step, epoch, values, tokens, time.perf_counter() - t0, position=update
        )
        cfg, rate = persist.boundary(
            sinks, cfg, patience, lambda cfg=cfg: _measure(cfg, backend, model, teacher, held)
        )
        if names.DISTILL_TEACHER_KL_MEAN in values:
            result.teacher_kl.append(values[names.DISTILL_TEACHER_KL_MEAN])
        log.debug("update %d: %s", update, {k: round(v, 4) for k, v in values.items()})
        if held is not None and _evaluate_now(cfg, update):
            improved = _evaluate(cfg, backend, model, teacher, held, pos, patience, result, sinks)
            if improved:
                persist.save_best(
                    cfg, run, pos.mark(), named, optimizer, plan, patience, steps, sinks
                )
        persist.maybe_checkpoint(
            cfg, run, pos.mark(), named, optimizer, plan, patience, steps, sinks, before
        )
        if patience.stop:
            result.stopped = "patience"
            break
    backend.close()
    # 4. export
    persist.export_or_keep(
        cfg, model, run_file, run, pos.mark(), named, optimizer, plan, tr.trained, patience, steps
    )
    result.updates, result.global_step = pos.update, pos.global_step
    result.best_eval = patience.best if patience.best != float("inf") else None
    result.seconds = time.perf_counter() - started
    sinks.finish(
        {
            "adapter": str(result.output),
            "teacher KL, first -> last update": _first_last(result.teacher_kl),
            "stopped early": result.stopped or "no",
        }
    )
    return result


def load_teacher(cfg, model):
    """The teacher GGUF on the student's device, checked to share its tokenizer."""
    from retrograd.model.model import load

    t0 = time.perf_counter()
    teacher = load(cfg.distill.teacher_path, device=cfg.model.device, threads=cfg.training.threads)
    context.check_same_tokenizer(model, teacher, "[distill].teacher_path")
    log.info("teacher loaded in %.2f s", time.perf_counter() - t0)
    return teacher


def _teacher_id(path) -> str:
    from retrograd.checkpoint import model_identity

    return model_identity(path).fingerprint


def _concurrency(cfg) -> int:
    """The reference's default: min(answers of an update, the optimizer window, 256)."""
    d, t = cfg.distill, cfg.training
    return t.generation_concurrency or min(d.prompts_per_update * d.samples_per_prompt, t.ctx, 256)


# -- the update ----------------------------------------------------------------------------


def _sample(cfg, backend, part, lo: int, *, update: int) -> list:
    """This rank's block of the update's (cursor, prompt) pairs: samples_per_prompt answers
    each, its groups numbered from `lo`."""
    d = cfg.distill
    return sample_groups(
        backend,
        part,
        update,
        lo,
        size=d.samples_per_prompt,
        sampling=d.sampling,
        concurrency=_concurrency(cfg),
    )


def _epoch(cfg, decoder, own: list[Rollout], trained: list[Rollout], world) -> dict[str, float]:
    """One pass over this rank's answers (`own`, of the update's `trained`): forward, loss and
    backward per pass of answers, gradients summed (the loss is normalised by the update's
    trained tokens), the terms summed over the ranks. The first pass stores the old
    log-probabilities it computes and the advantages they give."""
    d, training = cfg.distill, cfg.training
    total_tokens = float(sum(r.n_tokens for r in trained))
    coef = d.kl_coefficient
    sums = {"loss": 0.0, "surrogate": 0.0, "kl": 0.0, "clipped": 0.0}
    for piece in pieces(own, training.micro_batch, fanout(training)):
        lps = score(decoder, own, piece, training)
        batch = [own[i] for i in piece.members]
        width = max(len(lp) for lp in lps)
        mask = padded([np.ones(len(lp), np.float32) for lp in lps], width)
        for r, lp in zip(batch, lps, strict=True):
            if r.old_logprobs is None:
                r.old_logprobs = lp.detach().numpy().astype(np.float32)
                adv, _, _ = reverse_kl_advantages(
                    torch.from_numpy(r.old_logprobs),
                    torch.from_numpy(r.teacher_logprobs),
                    torch.ones(len(lp)),
                    d.weight_clip,
                )
                r.token_advantages = adv.numpy().astype(np.float32)
        logp = torch.nn.utils.rnn.pad_sequence(list(lps), batch_first=True)
        out = policy_loss(
            logp,
            padded([r.old_logprobs for r in batch], width),
            padded([r.token_advantages for r in batch], width),
            mask,
            clip_low=d.clip_range_low,
            clip_high=d.clip_range_high,
            ref_logp=padded([r.ref_logprobs for r in batch], width) if coef > 0 else None,
            kl_coef=coef,
            normalizer=total_tokens,
        )
        out.loss.backward()
        sums["loss"] += float(out.loss.detach())
        sums["surrogate"] += float(out.surrogate.detach())
        sums["kl"] += float(out.kl.detach())
        sums["clipped"] += float(out.clip_fraction) * float(mask.sum()) / total_tokens
    sums = spread.total(sums, world)
    values = {
        names.TOTAL_LOSS: sums["loss"],
        names.TRAIN_LOSS: sums["loss"],
        names.SURROGATE_LOSS: sums["surrogate"],
        names.CLIP_FRACTION: sums["clipped"],
    }
    if coef > 0:
        values[names.POLICY_KL] = sums["kl"]
    return values


# -- metrics and evaluation ----------------------------------------------------------------


def teacher_kl(
    student: list[np.ndarray], teacher: list[np.ndarray]
) -> tuple[float, np.ndarray, np.ndarray]:
    """(mean k over all tokens, each answer's mean k, every token's k), k = student − teacher."""
    ks = [
        np.asarray(s, np.float64) - np.asarray(t, np.float64)
        for s, t in zip(student, teacher, strict=True)
    ]
    tokens = np.concatenate(ks) if ks else np.zeros(0)
    per_answer = np.array([k.mean() if len(k) else 0.0 for k in ks])
    return (float(tokens.mean()) if len(tokens) else 0.0), per_answer, tokens


def _teacher_metrics(pairs: list[tuple], weight_clip: float) -> dict[str, float]:
    """From the trained answers' (student, teacher) log-probabilities, in the update's order."""
    mean, per_answer, k = teacher_kl([s for s, _ in pairs], [t for _, t in pairs])
    return {
        names.DISTILL_TEACHER_KL_MEAN: mean,
        names.DISTILL_TEACHER_KL_P95: float(np.percentile(per_answer, 95)),
        names.DISTILL_ADVANTAGE_CLIPPED: float(np.mean(np.abs(k) > weight_clip)),
    }


def _answer_metrics(answers: list[Rollout]) -> dict[str, float]:
    lengths = np.array([r.n_tokens for r in answers], dtype=np.float64)
    return {
        names.LENGTH_MEAN: float(lengths.mean()),
        names.LENGTH_MIN: float(lengths.min()),
        names.LENGTH_MAX: float(lengths.max()),
        names.TRUNCATION_FRACTION: float(np.mean([r.truncated for r in answers])),
        names.TRAINED_FRACTION: float(np.mean([r.eligible for r in answers])),
    }


def _measure(cfg, generator, model, teacher, held) -> dict | None:
    """The held-out teacher KL (as `loss`) with the weights as they are (None without
    [evaluation]), for a client's question to a served run; patience is not told."""
    if held is None:
        return None
    prompts = held_out(held, cfg.evaluation.max_examples)
    kl, _ = held_out_kl(cfg, generator, model, teacher, prompts)
    return {"examples": len(prompts), "loss": kl, "teacher_kl": kl}


def _evaluate_now(cfg, update: int) -> bool:
    return update % cfg.evaluation.every_iterations == 0 or update == cfg.distill.updates


def held_out_kl(cfg, backend, model, teacher, prompts) -> tuple[float, list[Rollout]]:
    """The student's mean teacher KL on one answer per prompt, sampled with seeds fixed for
    the run (the same adapter scores the same): k averaged over all the answers' tokens."""
    ks, answers = held_out_ks(cfg, backend, model, teacher, prompts)
    mean, _, _ = teacher_kl(ks, [np.zeros_like(k) for k in ks])
    return mean, answers


def held_out_ks(cfg, backend, model, teacher, prompts, first: int = 0):
    """One answer per prompt (prompt i of the held-out ones, `first` the index of the first
    here, sampled from its seed) and every answer's per-token k = student − teacher. ->
    (ks, answers)."""
    d = cfg.distill
    params = SamplingParams(d.sampling.temperature, d.sampling.top_p, d.sampling.max_new_tokens)
    seeds = [derive_seed(d.sampling.seed, EVALUATE, 0, first + i) for i in range(len(prompts))]
    requests = [
        SampleRequest(p.ids, params, seeds=(s,)) for p, s in zip(prompts, seeds, strict=True)
    ]
    answers = [
        Rollout(p, 0, i, 0, s, a.ids, a.text, False, np.asarray(a.logprobs, np.float32))
        for i, (p, s, [a]) in enumerate(
            zip(prompts, seeds, backend.generate(requests) if requests else [], strict=True)
        )
    ]
    scored = [r for r in answers if r.n_tokens]
    student = frozen_logprobs(lambda: nullcontext(None), model.decoder, scored, cfg.training)
    teach = frozen_logprobs(
        lambda: nullcontext(teacher.decoder), model.decoder, scored, cfg.training
    )
    _, _, k = teacher_kl(student, teach)
    ks, at = [], 0
    for r in answers:  # each answer's slice of the tokens' k (none for an empty answer)
        ks.append(k[at : at + r.n_tokens])
        at += r.n_tokens
    return ks, answers


def _evaluate(cfg, backend, model, teacher, held, pos, patience, result, sinks) -> bool:
    t0 = time.perf_counter()
    prompts = held_out(held, cfg.evaluation.max_examples)
    world = spread.current_world()
    ks = spread.spread(
        prompts,
        lambda part, lo: held_out_ks(cfg, backend, model, teacher, part, lo)[0],
        world,
    )
    kl, _, _ = teacher_kl(ks, [np.zeros_like(k) for k in ks])
    improved = patience.update(kl)
    result.evals.append((pos.update, kl))
    log.info(
        "evaluation at update %d: teacher KL %.4f in %.2f s",
        pos.update,
        kl,
        time.perf_counter() - t0,
    )
    sinks.evaluation(pos.global_step, {names.EVAL_TEACHER_KL: kl}, improved)
    return improved


def _first_last(values: list[float]) -> str:
    if not values:
        return "no update trained"
    return f"{values[0]:.4f} -> {values[-1]:.4f}"
