"""PPO's value head: zero at the start, blind to the features' scale, and restored exactly from
its checkpoint bytes (weights and AdamW state), so a resumed run trains it as the whole run."""

from __future__ import annotations

import torch

from retrograd.losses.value import value_loss
from retrograd.trainable.value_head import ValueHead


def _train(head: ValueHead, feats: torch.Tensor, target: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        head.optimizer.zero_grad(set_to_none=True)
        value_loss(head(feats), target, torch.ones_like(target)).backward()
        head.optimizer.step()


def test_starts_at_zero_and_ignores_the_scale_of_the_features():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(10, 16, generator=g)
    head = ValueHead(16, lr=0.01)
    assert torch.all(head(feats) == 0)
    _train(head, feats, torch.linspace(0, 1, 10), 5)
    torch.testing.assert_close(head(feats * 37.0), head(feats))
    assert head(feats.to(torch.bfloat16)).dtype == torch.float32


def test_a_step_is_bounded_whatever_the_scale_of_the_features():
    """Adam's first step is lr x sign(grad) per number: on features of norm 1 a value moves by
    at most lr (1 + sqrt(n_embd)) (the bias, then |ĥ|_1 <= sqrt(n)), whatever their scale."""
    for n in (16, 640):
        feats = (torch.randn(32, n) + 3.0) * 50.0  # a shared direction, large: the worst case
        head = ValueHead(n, lr=0.01)
        _train(head, feats, torch.ones(32), 1)
        moved = float(head(feats).detach().abs().max())
        assert 0.01 < moved <= 0.01 * (1 + n**0.5) + 1e-6, (n, moved)


def test_checkpoint_bytes_restore_the_head_and_its_optimizer_exactly():
    g = torch.Generator().manual_seed(1)
    feats, target = torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    whole = ValueHead(8, lr=0.05)
    _train(whole, feats, target, 6)
    cut = ValueHead(8, lr=0.05)
    _train(cut, feats, target, 3)
    resumed = ValueHead(8, lr=0.05)
    resumed.load_bytes(cut.state_bytes())
    _train(resumed, feats, target, 3)
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    weights = ValueHead.weights_of(whole.state_bytes())
    assert torch.equal(weights["linear.weight"], whole.linear.weight.detach())
