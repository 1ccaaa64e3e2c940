"""What a caller asks of the sampler, and what it gets back: frozen records, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from retrograd.sampling.grammar import Grammar
from retrograd.seeds import SAMPLE, derive_seed

FINISH_STOP = "stop"  # an end-of-generation token or a stop string
FINISH_LENGTH = "length"  # max_new_tokens, or the end of the context


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. `stop`: strings that end an answer (excluded from its text).
    `stop_ids`: token ids that end it (kept in its ids); None means the tokenizer's
    end-of-generation ids. `seed` seeds answer j through derive_seed(seed, "sample", sample=j)
    unless a request names its seeds. `grammar`: the answer's bytes must follow it
    (constrain.py); the answer ends once nothing more may follow."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] | None = None
    seed: int = 0
    grammar: Grammar | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be at least 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")


@dataclass(frozen=True)
class SampleRequest:
    """n answers to one prompt; they share one prefill of the prompt (KV fan-out)."""

    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    seeds: tuple[int, ...] | None = None  # one per answer; derived from params.seed when None

    def answer_seeds(self) -> tuple[int, ...]:
        if self.seeds is not None:
            assert len(self.seeds) == self.n, "one seed per answer"
            return self.seeds
        return tuple(derive_seed(self.params.seed, SAMPLE, sample=j) for j in range(self.n))


@dataclass(frozen=True)
class Completion:
    """One answer. `ids` are the sampled tokens (an ending token included), `logprobs` their
    log-probabilities under softmax(logits / temperature) before top-p (temperature 1 for
    greedy), `text` the decoded answer without its ending token or stop string."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # FINISH_STOP or FINISH_LENGTH
    text: str
    prompt_tokens: int
    stopped_by: int | str | None = None  # the ending token id or stop string
