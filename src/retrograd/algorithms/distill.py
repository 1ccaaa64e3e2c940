"""On-policy distillation of a LoRA adapter toward a teacher GGUF (mode = "on_policy"); the
offline top-k mode is algorithms/distill_offline.py, chosen by `run_distill`.

Each update: 1. choose prompts  2. the student samples samples_per_prompt answers each  3. the
teacher scores every sampled token  4. per-token advantages  5. reference scores (with a KL
term)  6. distill_epochs optimizer passes (policy.py)  7. report, evaluate, checkpoint
(frame.py). The variant
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
from functools import partial

import numpy as np
import torch

from retrograd.algorithms import context, frame, policy
from retrograd.algorithms.evaluate import Evaluation
from retrograd.losses.distill import reverse_kl_advantages
from retrograd.observe import names
from retrograd.rollout import spread
from retrograd.rollout.metrics import answer_metrics
from retrograd.rollout.passes import attach_logprobs, frozen_logprobs
from retrograd.rollout.records import Rollout
from retrograd.rollout.sample import (
    PromptStream,
    held_out,
    pass_over,
    read_prompt_files,
    sample_groups,
)
from retrograd.sampling.backend import sampler_identity
from retrograd.sampling.params import SampleRequest, SamplingParams
from retrograd.seeds import derive_seed

log = logging.getLogger(__name__)
EVALUATE = "evaluate"  # seeds of held-out answers
_NOT_TRAJECTORY = {"prompts"}  # [distill] keys a resumed run may change
# what a policy pass reports here (docs/metrics.md, "On-policy distillation")
_POLICY = (
    names.TOTAL_LOSS,
    names.TRAIN_LOSS,
    names.SURROGATE_LOSS,
    names.CLIP_FRACTION,
    names.SAMPLER_LOGPROB_GAP,
    names.LEARNING_RATE,
)


def run_distill(cfg, door=None, *, resume=None, sinks=None, run_file=None):
    """[run].algorithm = "distill": the loop of [distill].mode (algorithms/table.py)."""
    from retrograd.algorithms import table

    return table.run(cfg, door, resume=resume, sinks=sinks, run_file=run_file)


def run_on_policy(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    d, t = cfg.distill, cfg.training
    # 1. build: everything that can be checked is checked before the models load
    context.check_fanout(t, "distill")
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    files = read_prompt_files(cfg, d.prompts, "[distill].prompts")
    model = frame.model_of(cfg, door)
    teacher = load_teacher(cfg, model)
    prompts, held = files.render(context.chat_format(model), t.ctx)
    settings = {
        "distill": d.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        **sampler_identity(t),
        "reference": context.reference_id(cfg),
        "teacher": _teacher_id(d.teacher_path),
    }
    inputs = frame.Inputs(files.fingerprints, settings, *files.described(prompts, held))
    label, tracked = "teacher KL, first -> last update", names.DISTILL_TEACHER_KL_MEAN
    steps = d.updates * d.distill_epochs
    shape = frame.Shape(steps, d.updates, "update", tracked, label, "no update trained")
    run = frame.open_run(cfg, model, door, inputs, shape)
    reference = context.reference(cfg, model, run.tr.adapters) if d.kl_coefficient > 0 else None
    backend = context.rollout_backend(run, _concurrency(cfg))
    run = frame.evaluate_with(run, _evaluation(backend, model, teacher, held, run.world))
    stream = PromptStream(prompts, d.prompt_order, d.sampling.seed)
    pos, world = run.position, run.world
    with run.closing:
        for update in range(pos.update + 1, d.updates + 1):
            began, before = time.perf_counter(), pos.global_step
            # 2. samples_per_prompt answers to each prompt (each rank a block of the prompts)
            batch = stream.draw(pos.index, d.prompts_per_update)
            groups = spread.spread(batch, partial(_sample, cfg, backend, update=update), world)
            lo, hi = spread.block(len(groups), world)  # this rank's groups
            cursor = pos.index + d.prompts_per_update
            answers = [r for grp in groups for r in grp.members]
            if d.mask_truncated:
                for r in answers:
                    if r.truncated:
                        r.skip_reason = "truncated"
            trained = [r for r in answers if r.eligible]
            own = [r for grp in groups[lo:hi] for r in grp.members if r.eligible]
            values = answer_metrics(answers)
            values[names.TRAINED_FRACTION] = float(np.mean([r.eligible for r in answers]))
            values[names.GENERATION_SECONDS] = time.perf_counter() - began
            # 3-6. the teacher's and the reference's scores, distill_epochs optimizer steps
            step = pos.global_step
            if trained:
                step = _update(run, backend, teacher, reference, own, trained, update, step, values)
            for r in answers:
                r.trained = r.eligible and bool(trained)
            pos = pos.after_update(update, cursor, step)
            # 7. report, evaluate, checkpoint
            tokens = sum(r.n_tokens for r in answers)
            epoch = pass_over(cursor, len(prompts))
            report = frame.Report(
                values, tokens, began, epoch, before, trained=bool(trained), groups=groups
            )
            if frame.after_step(run, pos, report):
                break
    # export
    return frame.finish(run, pos)


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


def _update(run, backend, teacher, reference, own, trained, update: int, step: int, values) -> int:
    """This rank's answers scored by the teacher (and the reference, with a KL term), the
    advantages set at the first pass, distill_epochs optimizer steps, the teacher metrics.
    -> the global step after them."""
    d, t, decoder = run.cfg.distill, run.cfg.training, run.model.decoder
    t1 = time.perf_counter()
    attach_logprobs(lambda: nullcontext(teacher.decoder), decoder, own, t, "teacher_logprobs")
    if reference is not None:
        attach_logprobs(reference, decoder, own, t, "ref_logprobs")
    values[names.SCORING_SECONDS] = time.perf_counter() - t1
    t1 = time.perf_counter()
    step, out = policy.train(
        run, backend, own, policy.Surrogate.of(d), _pass(d, trained), d.distill_epochs,
        f"update {update}", step,
    )  # fmt: skip
    keys = _POLICY + ((names.POLICY_KL,) if d.kl_coefficient > 0 else ())
    values.update(policy.kept(out, keys))
    values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
    pairs = spread.everyone([(r.old_logprobs, r.teacher_logprobs) for r in own], run.world)
    values.update(_teacher_metrics(pairs, d.weight_clip))
    return step


def _pass(d, trained: list[Rollout]) -> policy.Pass:
    """The update's passes: the loss is the token mean over its trained tokens; the first
    pass sets each answer's advantages, −k capped at ±weight_clip, from the log-probabilities
    it scores (the weights that sampled) and the teacher's."""

    def advantages(fresh: list[Rollout]) -> None:
        for r in fresh:
            adv, _, _ = reverse_kl_advantages(
                torch.from_numpy(r.old_logprobs),
                torch.from_numpy(r.teacher_logprobs),
                torch.ones(len(r.old_logprobs)),
                d.weight_clip,
            )
            r.token_advantages = adv.numpy().astype(np.float32)

    tokens = float(sum(r.n_tokens for r in trained))
    return policy.Pass(tokens, tokens, len(trained), advantages="token", on_first=advantages)


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


def _evaluation(backend, model, teacher, held, world) -> Evaluation:
    """The held-out teacher KL (patience reads eval/teacher_kl, lower is better), each rank
    answering a block of the prompts; a client's evaluate: the same in one process."""
    if held is None:
        return Evaluation(None, measure=lambda cfg: None)

    def scheduled(cfg) -> dict[str, float]:
        prompts = held_out(held, cfg.evaluation.max_examples)
        ks = spread.spread(
            prompts, lambda part, lo: held_out_ks(cfg, backend, model, teacher, part, lo)[0], world
        )
        kl, _, _ = teacher_kl(ks, [np.zeros_like(k) for k in ks])
        return {names.EVAL_TEACHER_KL: kl}

    def measure(cfg) -> dict:
        prompts = held_out(held, cfg.evaluation.max_examples)
        kl, _ = held_out_kl(cfg, backend, model, teacher, prompts)
        return {"examples": len(prompts), "loss": kl, "teacher_kl": kl}

    return Evaluation(scheduled, names.EVAL_TEACHER_KL, measure=measure)


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
