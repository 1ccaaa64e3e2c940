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
