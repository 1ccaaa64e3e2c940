"""The rollout backend: what a rollout loop (GRPO, PPO, on-policy distillation, agentic GRPO)
asks of whatever samples its answers, behind one small interface; and the run's sampler,
built from [training] (`sampler`, `in_process`).

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
model's own decoder; `LlamaCppBackend` (llamacpp.py) decodes the run's GGUF as stored with
llama.cpp and applies the policy's adapter after each update; a backend that samples elsewhere
implements the same three methods (docs/distributed.md, "The rollout backend"). `rollout_backend`
builds the one [training].rollout_backend names. Agentic GRPO's multi-turn rollouts keep keys
and values between turns (`turns`): an in-process facility, which another backend would replace
by sending each turn's whole conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from retrograd.errors import RolloutBackendError
from retrograd.sampling.engine import (
    PREFILL_CHUNK,
    Sampler,
    TokenChooser,
    run_settings,
    sampling_plan,
)
from retrograd.sampling.params import Completion, SampleRequest

LOGITS_BUDGET = 64 << 20  # bytes of output logits a generation batch may hold (formats.md §8.1)


@runtime_checkable
class RolloutBackend(Protocol):
    """What the rollout loops sample through (the module docstring states the contract)."""

    kind: str  # "in_process" or "llama_cpp": [training].rollout_backend's word

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


def generation_batch(training, n_vocab: int, concurrency: int) -> int:
    """[training].generation_batch, or the reference's default (formats.md §8.1): the largest
    batch whose output logits (n_vocab float32 a row) fit LOGITS_BUDGET, capped by ctx and
    the engine's prefill chunk (512), then raised to the run's generation concurrency. The
    sampler prefills each prompt in passes of that many positions."""
    if training.generation_batch is not None:
        return training.generation_batch
    rows = LOGITS_BUDGET // (4 * n_vocab)
    return max(min(rows, training.ctx, PREFILL_CHUNK), concurrency)


def sampler_settings(model, training, concurrency: int) -> dict:
    """The Sampler's keywords a run's [training] sets: fast_sampling_context and kv_dtype (the
    cache), answers within ctx, prompts prefilled in passes of its generation batch."""
    return {
        **run_settings(training),
        "max_len": training.ctx,
        "generation_batch": generation_batch(training, model.config.n_vocab, concurrency),
    }


def sampler(model, training, concurrency: int) -> Sampler:
    """The run's sampler on the model's own decoder (`sampler_settings`); `concurrency`: how
    many answers the loop samples at once (an update's, up to its cap)."""
    return Sampler(model.decoder, model.tokenizer, **sampler_settings(model, training, concurrency))


def in_process(model, training, concurrency: int) -> InProcessBackend:
    """The run's in-process backend over `sampler`."""
    return InProcessBackend(sampler(model, training, concurrency))


def rollout_backend(model, training, concurrency: int, adapters=None) -> RolloutBackend:
    """The backend [training].rollout_backend names: `in_process`, or `llama_cpp` over the
    policy's adapters ({base name: LoRA}) as they are after each step."""
    if training.rollout_backend == "in_process":
        return in_process(model, training, concurrency)
    return llama_cpp(model, training, concurrency, adapters or {})


def sampler_identity(training) -> dict:
    """What of [training] changes the answers a resumed run samples: the sampling context, and
    the rollout backend with its importance-weight cap when it is not the default (so the
    checkpoints of in-process runs keep their identity)."""
    out = {"fast_sampling_context": training.fast_sampling_context}
    if training.rollout_backend != "in_process":
        out |= {"rollout_backend": training.rollout_backend, "is_cap": training.rollout_is_cap}
    return out


def llama_cpp(model, training, concurrency: int, adapters):
    """The llama.cpp backend over the model's file, with the run's sampling context: a float32
    KV cache and no flash attention where fast_sampling_context is off or kv_dtype is f32;
    the model's threads; up to `concurrency` answers decoded at once; prompts in passes of
    the generation batch. Refused (RolloutBackendError) with several ranks, and for a model on
    a GPU when llama.cpp was built for the CPU alone."""
    from retrograd.checkpoint.run import adapter_arrays
    from retrograd.distributed import world
    from retrograd.sampling.llamacpp import (
        MAX_SEQUENCES,
        AdapterSource,
        LlamaCppBackend,
        LlamaCppSettings,
        gpu_offload,
    )
    from retrograd.trainable.plan import trained_parameters

    key = '[training].rollout_backend = "llama_cpp"'
    if world().size > 1:
        raise RolloutBackendError(f"{key}: one process only; run without torchrun, or in_process")
    on_gpu = model.device.type != "cpu"
    if on_gpu and not gpu_offload():
        raise RolloutBackendError(
            f"{key}: the model trains on {model.device.type} and this llama-cpp-python was "
            "built for the CPU alone; install a GPU build (CMAKE_ARGS=-DGGML_CUDA=on), set "
            '[model].device = "cpu", or sample in_process'
        )
    fast = training.fast_sampling_context
    settings = LlamaCppSettings(
        threads=training.threads or torch.get_num_threads(),
        sequences=min(max(1, concurrency), MAX_SEQUENCES),
        ctx=training.ctx,
        batch=generation_batch(training, model.config.n_vocab, concurrency),
        kv_f32=not fast or training.kv_dtype == "f32",
        flash=fast,
        gpu_layers=-1 if on_gpu else 0,
    )
    source = None
    if adapters:
        alpha = next(iter(adapters.values())).alpha  # one alpha: the plan's (or the file's)
        source = AdapterSource(
            model.config.name, alpha, lambda: adapter_arrays(trained_parameters(adapters))
        )
    chooser = TokenChooser(model.tokenizer, max_len=training.ctx, plan=sampling_plan(model.decoder))
    return LlamaCppBackend(model.gguf.path, chooser, settings, source, model.config.n_vocab)
