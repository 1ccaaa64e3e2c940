"""GRPO: group-relative policy optimisation of a LoRA adapter, scored by a reward program.

Each update: 1. choose prompts  2. sample a group of answers per prompt  3. reward them (a
reward program, Python reward functions, a judge)  4. advantages  5. reference scores  6.
grpo_epochs optimizer passes (policy.py)  7. report, observe, evaluate, checkpoint (frame.py).
Phases 4-6 are `train_update`, which also trains on a caller's own groups. The variant (rollout/shaping.py, losses/policy.py say the formulas):
- advantages are the reward minus the group's baseline (its mean, or leave-one-out), not
  divided by the group's standard deviation (Dr. GRPO); a group whose rewards are all equal
  carries no signal and does not train; with [grpo.dynamic_sampling] it is replaced by a group
  of a fresh prompt, up to max_resample_factor x prompts_per_update prompts an update;
- the loss is the clipped surrogate with clip_range_low / clip_range_high, ratios per token or
  per answer (GSPO), averaged over the update's trained tokens (DAPO's token mean), plus
  kl_coefficient times the k3 estimate of KL toward the reference (the base model with the
  adapter switched off, or [reference].model);
- old log-probabilities come from the training path itself: the first pass of an update
  scores the answers with the weights that sampled them, so its ratios are exactly 1, and
  later passes compare with those values; the sampler's own log-probabilities (fast sampling
  context: a 16-bit cache) are only compared with them (policy/sampler_logprob_gap); when the
  sampler is not the trainer ([training].rollout_backend = "llama_cpp"), each token's surrogate
  term is weighted by min(pi_old / pi_sampler, rollout_is_cap) (truncated importance sampling,
  as TRL and verl correct a vLLM sampler; losses/correction.py);
- each pass over the update's answers is one optimizer step; the learning rate schedule counts
  updates x grpo_epochs steps;
- every random choice is a pure function of the run's seeds and the update: answer seeds from
  seeds.derive_seed([grpo.sampling].seed, "sample", update, prompt cursor, member), the prompt
  order a permutation per pass over the file; resume needs the update, the prompt cursor, the
  stall counter and the KL controller, all in the checkpoint;
- under torchrun each rank samples and rewards a block of each round's prompts, every rank
  then holds the whole update's groups (advantages, metrics and decisions as one process),
  scores and back-propagates its own answers, and the ranks' gradients are summed before the
  step (rollout/spread.py); rank 0 alone reports and observes.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from retrograd.algorithms import context, frame, policy
from retrograd.algorithms.evaluate import prompt_evaluation
from retrograd.errors import JudgeError, TrainingError
from retrograd.observe import names
from retrograd.rewards.callables import open_rewards
from retrograd.rewards.judge import group_id, open_judge
from retrograd.rewards.program import RewardRequest
from retrograd.rewards.ruler.prompt import Candidate
from retrograd.rollout import spread
from retrograd.rollout.metrics import (
    advantage_metrics,
    answer_metrics,
    group_metrics,
    reward_metrics,
)
from retrograd.rollout.passes import attach_logprobs
from retrograd.rollout.records import Group
from retrograd.rollout.sample import PromptStream, pass_over, read_prompt_files, sample_groups
from retrograd.rollout.shaping import (
    KlController,
    apply_overlong_penalty,
    assign_advantages,
    zero_signal,
)
from retrograd.sampling.backend import sampler_identity

log = logging.getLogger(__name__)
# [grpo] keys that change no step: a resumed run may change them
_NOT_TRAJECTORY = {
    "prompts",
    "reward_command",
    "reward_mode",
    "reward_timeout_seconds",
    "max_stalled_updates",
}


def total_steps(cfg) -> int:
    return cfg.grpo.updates * cfg.grpo.grpo_epochs


def concurrency(cfg) -> int:
    """The reference's default concurrency: min(answers of an update, the optimizer window,
    256), the window being ctx for rollouts (gradient_accumulation = ctx / micro_batch)."""
    g, t = cfg.grpo, cfg.training
    return t.generation_concurrency or min(g.prompts_per_update * g.group_size, t.ctx, 256)


def check_available(cfg) -> None:
    """Values the configuration reference allows that this loop cannot honour yet: refused
    before anything loads, naming the key (docs/configuration.md, "At run time")."""
    context.check_fanout(cfg.training, "grpo")


def run_grpo(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    g, t = cfg.grpo, cfg.training
    # 1. build: everything that can be checked is checked before the model loads
    check_available(cfg)
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    files = read_prompt_files(cfg, g.prompts, "[grpo].prompts", extra_keys=bool(door.rewards))
    model = frame.model_of(cfg, door)
    prompts, held = files.render(context.chat_format(model), t.ctx)
    settings = {
        "grpo": g.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        **sampler_identity(t),
        "reference": context.reference_id(cfg),
    }
    inputs = frame.Inputs(files.fingerprints, settings, *files.described(prompts, held))
    label = "mean reward, first -> last update"
    shape = frame.Shape(total_steps(cfg), g.updates, "update", names.REWARD_MEAN, label)
    run = frame.open_run(cfg, model, door, inputs, shape, observe="grpo")
    backend = context.rollout_backend(run, concurrency(cfg))
    program = run.closing.enter_context(
        open_rewards(g, "[grpo]", door.rewards, door.reward_weights)
    )
    judge = open_judge(g.judge, "[grpo.judge]", door.run_dir) if g.judge is not None else None
    run = frame.evaluate_with(run, prompt_evaluation(backend, program, held, g.sampling, run.world))
    reference = context.reference(cfg, model, run.tr.adapters)
    kl = KlController.from_section(g)
    if run.restored is not None:
        kl.load_state_dict(run.position.extra["kl"])
    stream, pos = PromptStream(prompts, g.prompt_order, g.sampling.seed), run.position
    with run.closing:
        for update in range(pos.update + 1, g.updates + 1):
            began, before = time.perf_counter(), pos.global_step
            # 2-3. a group per prompt, sampled and rewarded (each rank a block of the prompts)
            groups, mine, cursor, values = _sample_and_reward(
                run, backend, stream, program, judge, update, pos.index
            )
            _check_judge_drops(cfg, groups, update)
            members = [r for grp in groups for r in grp.members]
            values.update(reward_metrics(members) | group_metrics(groups) | answer_metrics(members))
            values[names.GROUPS_SAMPLED_FRACTION] = (cursor - pos.index) / g.prompts_per_update
            if judge is not None:
                values.update(_judge_metrics(groups, judge))
            # 4-6. advantages, reference scores, grpo_epochs passes
            pos, values = train_update(
                run, pos, groups, update, values, mine=mine, cursor=cursor,
                reference=reference, kl=kl, backend=backend,
            )  # fmt: skip
            # 7. report, observe, evaluate, checkpoint
            trained = pos.extra["stalled"] == 0
            tokens = sum(r.n_tokens for r in members)
            epoch = pass_over(cursor, len(prompts))
            report = frame.Report(
                values, tokens, began, epoch, before, trained=trained, groups=groups
            )
            if frame.after_step(run, pos, report):
                break
            if g.max_stalled_updates and pos.extra["stalled"] >= g.max_stalled_updates:
                run.result.stopped = f"{pos.extra['stalled']} updates in a row without signal"
                break
    # export; if that fails, the trained adapter is kept elsewhere and the error says where
    return frame.finish(run, pos)


def train_update(
    run: frame.Run,
    pos: frame.Position,
    groups: list[Group],
    update: int,
    values: dict[str, float] | None = None,
    *,
    mine: set[int] | None = None,
    cursor: int | None = None,
    reference=None,
    kl: KlController | None = None,
    backend=None,
    corrected: bool = False,
) -> tuple[frame.Position, dict[str, float]]:
    """Phases 4-6 of an update on rewarded `groups` (every member's reward set): advantages,
    [observe]'s records, reference scores when the KL coefficient is positive (`reference`:
    context.reference's factory), grpo_epochs optimizer steps on this rank's groups (`mine`:
    their indices; all of them by default); each member marked trained or not. A caller's own
    groups train the same way: answers without sampler log-probabilities take the first
    pass's (ratio 1), and no backend is told. -> (the position after the update, with
    `cursor` prompts drawn, the stall count and the KL controller; the update's values).
    Without `reference` and `kl`, the run's: the adapters switched off, a fresh controller.
    `corrected`: the answers' sampler log-probabilities are another sampler's (a caller's
    behaviour policy): each token's term is weighted by min(pi_old / pi_behaviour,
    [training].rollout_is_cap), as for a rollout backend that is not the trainer."""
    g, t = run.cfg.grpo, run.cfg.training
    values = {} if values is None else values
    kl = kl if kl is not None else KlController.from_section(g)
    mine = {grp.index for grp in groups} if mine is None else mine
    stats = assign_advantages(groups, g.baseline, g.mask_truncated)
    trained = [r for grp in groups for r in grp.members if r.eligible]
    # this rank's answers: it scores and back-propagates these
    own = [r for grp in groups if grp.index in mine for r in grp.members if r.eligible]
    frame.observe_rollouts(run, update, groups)  # before training: `trained` comes with the outcome
    coef = kl.value(update)
    values.update(advantage_metrics(stats))
    step, stalled = pos.global_step, int(pos.extra.get("stalled", 0))
    if trained:
        t1 = time.perf_counter()
        if coef > 0:
            reference = reference or context.reference(run.cfg, run.model, run.tr.adapters)
            attach_logprobs(reference, run.model.decoder, own, t, "ref_logprobs")
        values[names.SCORING_SECONDS] = time.perf_counter() - t1
        t1 = time.perf_counter()
        tokens = float(sum(r.n_tokens for r in trained))  # the loss is their token mean
        by_answer = g.importance_sampling_level == "sequence"
        cap = t.rollout_is_cap if corrected else None
        shape = policy.Pass(tokens, tokens, len(trained), by_answer=by_answer, is_cap=cap)
        surrogate = policy.Surrogate.of(g, kl_coef=coef)
        step, out = policy.train(
            run, backend, own, surrogate, shape, g.grpo_epochs, f"update {update}", step
        )
        values.update(out)
        values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
        for r in trained:
            r.trained = True
        kl.observe(values.get(names.POLICY_KL, 0.0), update)
        stalled = 0
    else:
        stalled += 1
    for grp in groups:
        for r in grp.members:
            if r.trained is None:
                r.trained = False
    values[names.KL_COEFFICIENT] = coef
    values[names.OPTIMIZER_STEPS] = step
    cursor = pos.index if cursor is None else cursor
    return pos.after_update(update, cursor, step, stalled=stalled, kl=kl.state_dict()), values


# -- sampling and rewards ------------------------------------------------------------------


def _sample_and_reward(run, backend, stream, program, judge, update: int, cursor: int):
    """The update's groups, sampled and rewarded, the indices of those this rank sampled, and
    the prompt cursor after them. Each rank samples and rewards a block of a round's prompts
    (one batch of the reward program each), and every rank gets the round's groups. With
    dynamic sampling, groups without signal are replaced by fresh prompts' groups while the
    prompt budget lasts."""
    cfg = run.cfg
    g = cfg.grpo
    want = g.prompts_per_update
    budget = want * (g.dynamic_sampling.max_resample_factor if g.dynamic_sampling else 1)
    kept: list[Group] = []
    dropped: list[Group] = []
    mine: set[int] = set()
    drawn = 0
    timing = {names.GENERATION_SECONDS: 0.0, names.REWARD_SECONDS: 0.0, names.JUDGE_SECONDS: 0.0}
    while True:
        n = min(want - len(kept), budget - drawn) if g.dynamic_sampling else want
        batch = stream.draw(cursor, n)
        cursor, drawn = cursor + n, drawn + n
        first = len(kept) + len(dropped)

        def roll(part, lo, first=first):
            t0 = time.perf_counter()
            groups = sample_groups(
                backend,
                part,
                update,
                first + lo,
                size=g.group_size,
                sampling=g.sampling,
                concurrency=concurrency(cfg),
            )
            t1 = time.perf_counter()
            judging = _reward(cfg, program, judge, groups) if groups else 0.0
            timing[names.GENERATION_SECONDS] += t1 - t0
            timing[names.REWARD_SECONDS] += time.perf_counter() - t1 - judging
            timing[names.JUDGE_SECONDS] += judging
            mine.update(grp.index for grp in groups)
            return groups

        groups = spread.spread(batch, roll, run.world)
        if not g.dynamic_sampling:
            return groups, mine, cursor, timing
        for grp in groups:
            (dropped if zero_signal(grp.rewards) else kept).append(grp)
        if len(kept) >= want or drawn >= budget:
            # what was not replaced stays in the update (and skips for want of signal)
            return kept + dropped[: max(0, want - len(kept))], mine, cursor, timing


def _reward(cfg, program, judge, groups: list[Group]) -> float:
    """One reward batch for every answer of these groups, the judge's verdicts and the
    overlong penalty applied; -> seconds spent judging."""
    g = cfg.grpo
    members = [r for grp in groups for r in grp.members]
    replies = program.score(
        [RewardRequest(r.prompt.text, r.text, r.prompt.record) for r in members]
    )
    weights = {}
    for r, reply in zip(members, replies, strict=True):
        r.reward_raw = reply.reward
        weights[id(r)] = g.judge_weight if reply.judge_weight is None else reply.judge_weight
    t0 = time.perf_counter()
    if judge is not None:
        _judge_groups(cfg, judge, groups, weights)
    if g.overlong_penalty is not None:
        o = g.overlong_penalty
        apply_overlong_penalty(groups, g.sampling.max_new_tokens, o.buffer_tokens, o.max_penalty)
    return time.perf_counter() - t0


def _judge_groups(cfg, judge, groups: list[Group], weights: dict[int, float]) -> None:
    """reward += weight x verdict (formats.md §3.5), every group's requests at once; a group
    whose every weight is 0 is not sent. A failing judge drops the group (it keeps its
    verifiable reward but leaves the baseline and the loss), or fails the run with
    judge_failure = "fail"."""
    sent, jobs = [], []
    for grp in groups:
        if not any(weights[id(r)] for r in grp.members):
            for r in grp.members:
                r.judge_term = 0.0
            continue
        candidates = [
            Candidate([*r.prompt.messages, {"role": "assistant", "content": r.text}])
            for r in grp.members
        ]
        sent.append(grp)
        jobs.append((candidates, group_id(grp.update, grp.index), grp.prompt.rubric))
    for grp, verdicts in zip(sent, judge.score_groups(jobs), strict=True):
        if isinstance(verdicts, JudgeError):
            if cfg.grpo.judge_failure == "fail":
                raise verdicts
            log.warning(
                "update %d, group %d: %s; the group is dropped", grp.update, grp.index, verdicts
            )
            grp.skip("judge_dropped")
            continue
        for r, v in zip(grp.members, verdicts, strict=True):
            r.judge_term = weights[id(r)] * v


def _judge_metrics(groups: list[Group], judge) -> dict[str, float]:
    """judge/ metrics of the update (formats.md §7.2): the judge's own (requests, latency,
    cache hits, budgets: a ruler judge's stats()), then the loop's counts."""
    dropped = [grp.members[0].skip_reason == "judge_dropped" for grp in groups]
    terms = [r.judge_term for grp in groups for r in grp.members if r.judge_term is not None]
    values = {**judge.stats(), names.JUDGE_DROPPED_FRACTION: float(np.mean(dropped))}
    if terms:
        values[names.REWARD_JUDGE_MEAN] = float(np.mean(terms))
    return values


def _check_judge_drops(cfg, groups: list[Group], update: int) -> None:
    if cfg.grpo.judge is None:
        return
    dropped = sum(1 for grp in groups if grp.members[0].skip_reason == "judge_dropped")
    limit = cfg.grpo.max_judge_dropped_fraction
    if dropped / len(groups) > limit:
        raise TrainingError(
            f"update {update}: the judge failed on {dropped} of {len(groups)} groups, more "
            f"than [grpo].max_judge_dropped_fraction = {limit}; see the judge errors above"
        )
