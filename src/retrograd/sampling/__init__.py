"""Generation: batched prefill and decode with a KV cache, prompt fan-out, seeded sampling.

sampler = Sampler(model.decoder, model.tokenizer, fast=True)
[[answer]] = sampler.generate([SampleRequest(tuple(ids), SamplingParams(temperature=0.7))])
answer.ids, answer.logprobs, answer.finish_reason, answer.text
"""

from retrograd.sampling.engine import Sampler
from retrograd.sampling.params import (
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    SampleRequest,
    SamplingParams,
)

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Completion",
    "SampleRequest",
    "Sampler",
    "SamplingParams",
]
