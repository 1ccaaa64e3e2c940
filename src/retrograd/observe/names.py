"""Metric names (formats.md §7.2): the strings every sink and dashboard sees.

Loops log through these constants, so one grep finds every place a curve comes from. Names are
`family/name`; the families are train/ eval/ reward/ policy/ completions/ batch/ optimizer/
system/ plus per-algorithm ones. Add an algorithm's names here when its loop is written.
"""

from __future__ import annotations

# SFT base set, shared by every loop that trains on text.
TRAIN_LOSS = "train/loss"
TOKENS_PER_SECOND = "system/tokens_per_second"
LEARNING_RATE = "optimizer/learning_rate"

# Evaluation, logged at the global step it ran after, only when evaluated and finite.
EVAL_LOSS = "eval/loss"
EVAL_PERPLEXITY = "eval/perplexity"  # formats.md marks this name [AMBIGUOUS]; docs/metrics.md

SFT = (TRAIN_LOSS, TOKENS_PER_SECOND, LEARNING_RATE, EVAL_LOSS, EVAL_PERPLEXITY)

# GRPO (formats.md §7.2). policy/total_loss = surrogate + kl_coef * kl, also reported as
# train/loss; policy/sampler_logprob_gap is ours: the mean |sampler - trainer| log-probability
# of the sampled tokens (the fast sampling context's rounding, and the cache's).
REWARD_MEAN = "reward/mean"
REWARD_MIN = "reward/min"
REWARD_MAX = "reward/max"
REWARD_STD = "reward/std"
REWARD_GROUP_STD = "reward/group_std"
REWARD_VERIFIABLE_MEAN = "reward/verifiable_mean"
REWARD_JUDGE_MEAN = "reward/judge_mean"
LENGTH_MEAN = "completions/length_mean"
LENGTH_MIN = "completions/length_min"
LENGTH_MAX = "completions/length_max"
TRUNCATION_FRACTION = "completions/truncation_fraction"
ZERO_STD_GROUP_FRACTION = "batch/zero_std_group_fraction"
ADVANTAGE_ABS_MEAN = "batch/advantage_abs_mean"
TRAINED_FRACTION = "batch/trained_fraction"
GROUPS_SAMPLED_FRACTION = "batch/groups_sampled_fraction"
SURROGATE_LOSS = "policy/surrogate_loss"
POLICY_KL = "policy/kl"
REFERENCE_KL = "policy/reference_kl"  # PPO's KL term toward the reference, when it is on
CLIP_FRACTION = "policy/clip_fraction"
TOTAL_LOSS = "policy/total_loss"
KL_COEFFICIENT = "policy/kl_coefficient"
SAMPLER_LOGPROB_GAP = "policy/sampler_logprob_gap"
# When the sampler is not the trainer: the truncated importance weights' mean over the trained
# tokens and the share the cap cut ([training].rollout_is_cap, losses/correction.py)
SAMPLER_IS_WEIGHT_MEAN = "policy/sampler_is_weight_mean"
SAMPLER_IS_TRUNCATED = "policy/sampler_is_truncated_fraction"
# Ours too, to see an update's size and health (GRPO and PPO): the ratio's mean and extremes
# over the trained tokens, the clipped share split by side, the sample estimate of the
# entropy (mean -log pi_old of the sampled tokens), the gradient norm before clipping, the
# optimizer steps taken so far, and the spread of the advantages (before PPO's whitening).
RATIO_MEAN = "policy/ratio_mean"
RATIO_MIN = "policy/ratio_min"
RATIO_MAX = "policy/ratio_max"
CLIP_LOW_FRACTION = "policy/clip_fraction_low"
CLIP_HIGH_FRACTION = "policy/clip_fraction_high"
ENTROPY = "policy/entropy"
GRAD_NORM = "optimizer/grad_norm"
OPTIMIZER_STEPS = "optimizer/steps"
ADVANTAGE_STD = "batch/advantage_std"
REWARD_SECONDS = "timing/reward_seconds"
JUDGE_SECONDS = "timing/judge_seconds"
GENERATION_SECONDS = "timing/generation_seconds"
SCORING_SECONDS = "timing/scoring_seconds"
OPTIMIZER_SECONDS = "timing/optimizer_seconds"
OBSERVE_DROPPED = "observe/dropped_batches"
EVAL_MEAN_REWARD = "eval/mean_reward"
EVAL_REWARD_MIN = "eval/reward_min"
EVAL_REWARD_MAX = "eval/reward_max"

# PPO (formats.md §7.2): the reward, policy and evaluation names above, and with the critic on
# the value head's loss (mean over its value_epochs passes), its stored features' size and how
# much of the returns' variance its values (before it trains on the batch) explain.
VALUE_LOSS = "policy/value_loss"
FEATURE_MIB = "critic/feature_mib"
EXPLAINED_VARIANCE = "critic/explained_variance"

# Preference (formats.md §7.2): means over the step's pairs. chosen_logps / rejected_logps are
# summed log-probabilities of the answers' written tokens (nats); rewards, margin and accuracy
# as losses/preference.py defines them per loss; nll, log_odds and orpo_clamped for orpo only.
PREFERENCE_LOSS = "preference/loss"
PREFERENCE_ACCURACY = "preference/accuracy"
PREFERENCE_MARGIN = "preference/margin"
PREFERENCE_CHOSEN_REWARD = "preference/chosen_reward"
PREFERENCE_REJECTED_REWARD = "preference/rejected_reward"
PREFERENCE_CHOSEN_LOGPS = "preference/chosen_logps"
PREFERENCE_REJECTED_LOGPS = "preference/rejected_logps"
PREFERENCE_PAIRS_PER_STEP = "preference/pairs_per_step"
PREFERENCE_NLL = "preference/nll"
PREFERENCE_LOG_ODDS = "preference/log_odds"
PREFERENCE_ORPO_CLAMPED = "preference/orpo_clamped"
EVAL_PREFERENCE_LOSS = "eval/preference_loss"
EVAL_ACCURACY = "eval/accuracy"
EVAL_MARGIN = "eval/margin"
EVAL_CHOSEN_LOGPS = "eval/chosen_logps"
EVAL_REJECTED_LOGPS = "eval/rejected_logps"

# On-policy distillation (formats.md §7.2). teacher_kl_mean: the mean over the update's trained
# tokens of k = log π_student − log p_teacher at the sampled token (the sampled-token estimate
# of KL(student ‖ teacher), nats per token); teacher_kl_p95: the 95th percentile over answers of
# an answer's mean k; advantage_clipped_fraction: share of trained tokens whose |k| exceeded
# weight_clip. Also the policy/* values of the update, completions/*, and eval/teacher_kl: the
# mean k of one answer per held-out prompt (lower is better).
DISTILL_TEACHER_KL_MEAN = "distill/teacher_kl_mean"
DISTILL_TEACHER_KL_P95 = "distill/teacher_kl_p95"
DISTILL_ADVANTAGE_CLIPPED = "distill/advantage_clipped_fraction"
EVAL_TEACHER_KL = "eval/teacher_kl"

# Agentic GRPO (formats.md §7.2). Fractions are over the update's requested trajectories:
# truncated (a limit cut it), failed (the environment failed it: failed_tool; the chat template
# could not continue it: failed_policy), lost (not trained for any of those or for want of a
# score). tool_error_fraction: failed calls over calls. Per trajectory: turns, policy tokens;
# per turn: calls. generation/prefill_reuse_fraction: positions served from kept keys and
# values over all positions the turns needed; prefilled_tokens: positions computed by
# prefills. timing/tool_seconds (ours): time in episodes (open, calls, verify, close).
AGENT_TRUNCATED_FRACTION = "agent/truncated_fraction"
AGENT_FAILED_FRACTION = "agent/failed_fraction"
AGENT_FAILED_TOOL = "agent/failed_tool"
AGENT_FAILED_POLICY = "agent/failed_policy"
AGENT_LOST_FRACTION = "agent/lost_fraction"
AGENT_TOOL_ERROR_FRACTION = "agent/tool_error_fraction"
AGENT_TURNS_MEAN = "agent/turns_per_traj_mean"
AGENT_TOKENS_MEAN = "agent/tokens_per_traj_mean"
AGENT_CALLS_PER_TURN = "agent/tool_calls_per_turn"
GENERATION_PREFILL_REUSE = "generation/prefill_reuse_fraction"
GENERATION_PREFILLED_TOKENS = "generation/prefilled_tokens"
ROLLOUT_SECONDS = "timing/rollout_seconds"
TOOL_SECONDS = "timing/tool_seconds"
JUDGE_DROPPED_FRACTION = "judge/dropped_group_fraction"
JUDGE_DEGENERATE_FRACTION = "judge/degenerate_group_fraction"
JUDGE_SCORE_MEAN = "judge/score_mean"
JUDGE_SCORE_STD = "judge/score_std"
# The ruler judge's own counters (RulerJudge.stats), since the last update.
JUDGE_POSITION_DISAGREEMENT = "judge/position_disagreement"
JUDGE_PROMPT_CHARS_MAX = "judge/prompt_chars_max"
JUDGE_ELIDED_FRACTION = "judge/elided_fraction"
JUDGE_COMPACTED_FRACTION = "judge/compacted_fraction"
JUDGE_GROUPS = "judge/groups"
JUDGE_REQUESTS = "judge/requests"
JUDGE_REQUESTS_PER_GROUP = "judge/requests_per_group"
JUDGE_RETRIES = "judge/retries"
JUDGE_LATENCY_MS_MEAN = "judge/latency_ms_mean"
JUDGE_CACHE_HIT_RATE = "judge/cache_hit_rate"
