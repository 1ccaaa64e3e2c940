"""[training].generation_batch: the reference's derived default (formats.md §8.1) on a tiny
vocabulary and on Gemma's 262k one, and what the rollout loops do with a value."""

from __future__ import annotations

import pytest

from retrograd.algorithms.context import check_fanout
from retrograd.config.training import TrainingSection
from retrograd.gguf import GGUFFile
from retrograd.model.config import ModelConfig
from retrograd.sampling.backend import LOGITS_BUDGET, generation_batch


def vocab(path) -> int:
    return ModelConfig.from_gguf(GGUFFile(path)).n_vocab


def test_a_tiny_vocabulary_is_capped_by_ctx_and_raised_to_the_concurrency(tiny_model):
    n_vocab = vocab(tiny_model("gemma3"))
    assert LOGITS_BUDGET // (4 * n_vocab) > 512  # the logits budget is no limit here
    assert generation_batch(TrainingSection(), n_vocab, 16) == 128  # ctx 128
    assert generation_batch(TrainingSection(ctx=4096), n_vocab, 16) == 512  # the engine's cap
    assert generation_batch(TrainingSection(ctx=64), n_vocab, 256) == 256  # the concurrency


def test_a_262k_vocabulary_keeps_the_logits_within_64_mib(gemma_path):
    n_vocab = vocab(gemma_path)
    assert n_vocab == 262144
    # 64 rows of 262144 float32 logits are 64 MiB
    assert generation_batch(TrainingSection(ctx=4096), n_vocab, 8) == 64
    assert generation_batch(TrainingSection(ctx=32), n_vocab, 8) == 32  # ctx caps it
    assert generation_batch(TrainingSection(ctx=4096), n_vocab, 100) == 100  # raised


def test_a_value_set_is_taken_as_it_is():
    training = TrainingSection(generation_batch=3)
    assert generation_batch(training, 262144, 64) == 3
    assert generation_batch(training, 512, 1) == 3


def test_the_rollout_loops_accept_it():
    check_fanout(TrainingSection(generation_batch=8), "grpo")  # no error


def test_the_sampler_refuses_a_batch_below_one(tiny_model):
    import retrograd
    from retrograd.sampling import Sampler

    m = retrograd.load(tiny_model("gemma3"), device="cpu")
    with pytest.raises(ValueError, match="generation_batch = 0: must be at least 1"):
        Sampler(m.decoder, m.tokenizer, generation_batch=0)
