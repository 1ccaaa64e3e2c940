"""The rollout backend: what a rollout loop (GRPO, PPO, on-policy distillation, agentic GRPO)
asks of whatever samples its answers, behind one small interface.

A loop hands the backend sampling requests (a prompt's token ids, the sampling settings, n and
one seed per answer) and gets back, per request, n completions: the sampled token ids, their
log-probabilities under the policy that sampled them (the behaviour log-probabilities), the
finish reason and the decoded text. The contract every backend keeps (docs/distributed.md,
"Rollouts"):

- an answer is a function of its prompt, its settings, its seed and the policy's weights,
  not of the other requests of the call nor of how many processes sample: a group sampled by
  rank 1 of 2 is the group one process samples (up to the rounding of a batch);
- `policy_changed(step)` is called after every optimizer step that moved the trained weights;
  answers sampled after it come from the new weights. The in-process sampler shares the
  training model's weights, so it has nothing to do; a server backend pushes the adapter;
- the behaviour log-probabilities are those of the sampling policy at temperature
  `temperature` (softmax(logits / T) before top-p). The loops never train on them: the first
  training pass rescores every answer (its ratios are exactly 1) and compares the two
  (policy/sampler_logprob_gap), which is the check a server backend's numerics must pass;
- `close()` releases what the backend holds; the loops call it once, at the end.

`InProcessBackend` is the sampler in this process (sampling/engine.py) on the training
model's own decoder. A vLLM server backend (an OpenAI-compatible server with the GGUF
plugin, the LoRA adapter reloaded in place under a fixed name after each update, the first
update's log-probabilities compared with the training path's) would implement the same three
methods; it is not built. Agentic GRPO's multi-turn rollouts keep keys and values between
turns (`turns`): an in-process facility, which a server backend would replace by sending
each turn's whole conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from retrograd.sampling.params import Completion, SampleRequest


@runtime_checkable
class RolloutBackend(Protocol):
    """What the rollout loops sample through (the module docstring states the contract)."""

    kind: str  # "in_process"; the name a run's logs and docs use

    def generate(self, requests: Sequence[SampleRequest]) -> list[list[Completion]]:
        """Per request, its n completions in the order of its seeds."""
        ...

    def policy_changed(self, step: int) -> None:
        """The trained weights moved (optimizer step `step`): later answers follow them."""
        ...

    def close(self) -> None: ...


class InProcessBackend:
    """The in-process sampler over the training model's decoder: it reads the weights as they
    are, so an update needs no transfer."""

    kind = "in_process"

    def __init__(self, sampler):
        self.sampler = sampler

    @property
    def tokenizer(self):
        return self.sampler.tokenizer

    def generate(self, requests: Sequence[SampleRequest]) -> list[list[Completion]]:
        return self.sampler.generate(list(requests))

    def policy_changed(self, step: int) -> None:
        return None  # the sampler reads the trained Parameters themselves

    def turns(self, keep_kv: bool | None = None):
        """A multi-turn decoder keeping each trajectory's keys and values between turns
        (sampling/turns.py), for agentic rollouts."""
        from retrograd.sampling.turns import TurnDecoder

        return TurnDecoder(self.sampler, keep_kv)

    def close(self) -> None:
        return None


def in_process(model, training, concurrency: int) -> InProcessBackend:
    """The run's in-process backend: context.sampler's settings ([training].fast_sampling_context,
    kv_dtype, ctx, the generation batch derived from `concurrency`)."""
    from retrograd.algorithms import context

    return InProcessBackend(context.sampler(model, training, concurrency))
