"""SFT passes and steps: splits, checkpointing and schedules keep the plain path's numbers."""

from __future__ import annotations

import math

import pytest
import torch

import retrograd
from retrograd.algorithms.step import (
    LossOptions,
    backward_group,
    groups_of,
    new_cache,
    restore_window,
    window_bytes,
)
from retrograd.data.sft import Example, permutation
from retrograd.optim import lr_at
from retrograd.optim.build import DecoupledSGD
from retrograd.trainable.lora import attach_lora

IDS = tuple([1] + [(i * 37) % 500 + 3 for i in range(31)])
MASK = tuple([0] * 6 + [1] * 20 + [0] * 3 + [1] * 3)
EX = Example(IDS, MASK, "test:1")


def model_with_lora(tiny_model, name="gemma3"):
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    loras = attach_lora(m.decoder, ["auto"], rank=4, alpha=8.0, seed=1)
    with torch.no_grad():
        for lo in loras.values():
            lo.lora_b.normal_(std=0.02)  # non-zero B: A gets gradients too
    return m, loras


def grads(loras) -> torch.Tensor:
    out = torch.cat([p.grad.flatten() for lo in loras.values() for p in (lo.lora_a, lo.lora_b)])
    for lo in loras.values():
        lo.zero_grad()
    return out


def test_groups_cover_the_window_and_count_targets():
    groups = groups_of(EX, 8, 2)
    assert [g.passes for g in groups] == [((0, 8), (8, 16)), ((16, 24), (24, 32))]
    assert sum(g.n_targets for g in groups) == sum(MASK[1:])
    trailing = Example(IDS, MASK[:20] + (0,) * 12, "t")
    assert groups_of(trailing, 8, 1)[-1].passes == ((16, 24),)  # no target after 19 -> dropped


def test_passes_without_a_trained_token_join_the_next_step():
    # a long prompt (nothing trained before position 19), an answer, a gap, another answer
    mask = (0,) * 19 + (1,) * 5 + (0,) * 4 + (1,) * 4
    ex = Example(IDS, mask, "t")
    groups = groups_of(ex, 4, 1)
    assert groups[0].passes == ((0, 4), (4, 8), (8, 12), (12, 16), (16, 20))
    assert [g.passes[-1] for g in groups] == [(16, 20), (20, 24), (24, 28), (28, 32)]
    assert all(g.n_targets > 0 for g in groups)
    assert sum(g.n_targets for g in groups) == sum(mask[1:])
    # every pass of the window runs once, in order, whatever the accumulation
    for acc in (1, 2, 3):
        flat = [p for g in groups_of(ex, 4, acc) for p in g.passes]
        assert flat == [(s, s + 4) for s in range(0, 32, 4)]


def test_a_step_after_context_passes_scores_what_one_pass_scores(tiny_model):
    # micro_batch 4 with accumulation 1: the first steps have no target (the ZeroDivisionError
    # of a chat prompt longer than a pass); the steps' token-weighted losses equal one pass's
    m, _ = model_with_lora(tiny_model)
    mask = (0,) * 19 + (1,) * 5 + (0,) * 4 + (1,) * 4
    ex = Example(IDS, mask, "t")
    opts = LossOptions(chunked=False)
    cache = new_cache(m.decoder, ex, torch.float32)
    total = sum(
        backward_group(m.decoder, ex, g, cache, opts) * g.n_targets for g in groups_of(ex, 4, 1)
    )
    (whole,) = groups_of(ex, 32, 1)
    one = backward_group(m.decoder, ex, whole, new_cache(m.decoder, ex, torch.float32), opts)
    assert math.isclose(total / sum(mask[1:]), one, rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_window_cache_round_trips_byte_for_byte(tiny_model, dtype):
    m, _ = model_with_lora(tiny_model)
    cache = new_cache(m.decoder, EX, dtype)
    with torch.no_grad():
        m.decoder(torch.tensor([EX.ids[:20]]), start=0, cache=cache)
    back = restore_window(window_bytes(cache, 20), m.decoder, EX, dtype, 20)
    for a, b in zip(cache.k + cache.v, back.k + back.v, strict=True):
        assert torch.equal(a[:, :, :20].view(torch.uint8), b[:, :, :20].view(torch.uint8))
        assert not b[:, :, 20:].any()
    with pytest.raises(Exception, match="does not fit"):
        restore_window(window_bytes(cache, 20), m.decoder, EX, dtype, 16)


@pytest.mark.parametrize("micro_batch", [8, 16])
def test_micro_batch_split_gives_the_whole_window_loss(tiny_model, micro_batch):
    # The same window in one pass or in passes that see earlier passes as cached context:
    # the same loss (forward values do not depend on where gradients stop).
    m, _ = model_with_lora(tiny_model)
    opts = LossOptions(chunked=True, tiles=3, seq_chunk=0)
    whole = groups_of(EX, 32, 1)
    split = groups_of(EX, micro_batch, 32 // micro_batch)
    assert len(whole) == len(split) == 1
    a = backward_group(m.decoder, EX, whole[0], new_cache(m.decoder, EX, torch.float32), opts)
    b = backward_group(m.decoder, EX, split[0], new_cache(m.decoder, EX, torch.float32), opts)
    assert math.isclose(a, b, rel_tol=1e-5)


@pytest.mark.parametrize(
    "stride, dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32)]
)
def test_gradient_checkpointing_equals_plain(tiny_model, stride, dtype):
    m, loras = model_with_lora(tiny_model)
    opts = LossOptions()
    (g,) = groups_of(EX, 32, 1)
    plain_loss = backward_group(m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), opts)
    plain = grads(loras)
    m.decoder.enable_checkpointing(stride, dtype)
    ck_loss = backward_group(m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), opts)
    ck = grads(loras)
    assert math.isclose(plain_loss, ck_loss, rel_tol=1e-6)
    torch.testing.assert_close(ck, plain, rtol=1e-5, atol=1e-7)


def test_chunked_and_plain_loss_give_the_same_gradients(tiny_model):
    m, loras = model_with_lora(tiny_model, "llama")
    (g,) = groups_of(EX, 32, 1)
    a = backward_group(
        m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), LossOptions(chunked=False)
    )
    ga = grads(loras)
    b = backward_group(
        m.decoder, EX, g, new_cache(m.decoder, EX, torch.float32), LossOptions(tiles=5, seq_chunk=7)
    )
    gb = grads(loras)
    assert math.isclose(a, b, rel_tol=1e-5)
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)


def test_schedules():
    assert lr_at(0, 10, 1.0, "constant", 0) == 1.0
    assert lr_at(0, 10, 1.0, "linear", 4) == 0.25 and lr_at(3, 10, 1.0, "linear", 4) == 1.0
    assert lr_at(4, 10, 1.0, "linear", 4) == 1.0 and lr_at(
        9, 10, 1.0, "linear", 4
    ) == pytest.approx(1 / 6)
    assert lr_at(5, 10, 1.0, "cosine", 0) == pytest.approx(0.5)
    assert lr_at(10, 10, 1.0, "cosine", 0) == pytest.approx(0.0, abs=1e-12)


def test_decoupled_sgd_shrinks_weights_by_lr_times_decay():
    p = torch.nn.Parameter(torch.tensor([2.0]))
    opt = DecoupledSGD([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.tensor([1.0])
    opt.step()
    assert float(p.detach()) == pytest.approx(2.0 * (1 - 0.05) - 0.1)


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    a, b = permutation(50, 42, 3), permutation(50, 42, 3)
    assert (a == b).all() and not (a == permutation(50, 42, 4)).all()
    assert sorted(a.tolist()) == list(range(50))


def test_patience_counts_evaluations_without_improvement():
    from retrograd.algorithms.evaluate import Patience

    p = Patience(patience=2, min_delta=0.1)
    assert p.update(1.0) and not p.stop
    assert not p.update(0.95)  # better, but by less than min_delta
    assert not p.stop
    assert not p.update(1.2)
    assert p.stop and p.best == 1.0
    assert not Patience(None).stop
