"""The compute plan: how a process computes, decided once from the run file and the environment.

`ComputePlan.of(environ.read(), ...)` gathers every switch of the forward pass, the weights and
the sampler (an environment variable wins over the run file or the caller's argument, which
win over the default, and `sources` says which one chose). The loader resolves it against the
machine and the model (`Resolved`: device, compute type, the dense cache, the decode graph),
which a run prints at its start. A forward pass reads its switches from `current()`: the
sampler's overlay (`using`, fast one-token attention and packed weights while it generates),
else the plan a command installed (`install`), else the environment read afresh (a test that
sets RETRO_COMPILE sees its change).

Where a new mode plugs in: a field here, its row in retrograd/environ.py or the run file, the
code that reads it once (the loader for `WeightsPlan`, the sampler for `SamplingPlan`, the
forward context for `ForwardPlan`), and an equality test against the plain path
(docs/exactness.md). Knows names and switches; nothing about models or tensors beyond dtypes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from retrograd import environ
from retrograd.environ import Environ
from retrograd.threads import asked_threads, wait_policy

CACHE_FRACTION = 0.4  # the dense cache may take this share of the memory still available
# The 8-bit store stands in for reading the file's pages (1.65x a Q4_K_M file's bytes), so auto
# lets it take more than a dense cache beside them (docs/performance.md "Memory").
INT8_FRACTION = 0.6
CACHE_MODES = ("auto", "on", "off", "int8")  # "layers" (the layers that fit) would plug in here
PRODUCTS = ("dequantize",)  # 33: "int8", "int4" (products on quantized weights)
BACKENDS = ("in_process", "llama_cpp")  # [training].rollout_backend


@dataclass(frozen=True)
class ThreadsPlan:
    """intra: the intra-op thread count asked for (RETRO_THREADS, else [training].threads or
    load(threads=)); None keeps PyTorch's own count within the usable CPUs. wait: OpenMP's
    wait policy, set when the package was imported (retrograd/threads.py)."""

    intra: int | None = None
    interop: int | None = None
    wait: str = ""


@dataclass(frozen=True)
class WeightsPlan:
    """How frozen weights are held and multiplied. cache: the dequantized-weight cache
    (CACHE_MODES: "int8" keeps 8-bit rows with a scale each instead of dense copies, and
    products read them); products: what a frozen product reads otherwise (dequantized dense
    copies). budget_fraction, int8_fraction: the share of free memory auto lets a dense cache,
    else the 8-bit store, take."""

    cache: str = "auto"
    products: str = "dequantize"
    budget_fraction: float = CACHE_FRACTION
    int8_fraction: float = INT8_FRACTION


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward pass reads. compile: fused kernels and the decode graph compiled
    (RETRO_COMPILE); fast_decode: one-token attention in float32 straight from the cache (the
    fast sampling context); packed: dtypes whose gradient-free products read oneDNN-packed
    weights; fuse: the fused 16-bit kernels, None for "outside float32" (tests force it)."""

    compile: bool = True
    fast_decode: bool = False
    packed: frozenset = frozenset()
    fuse: bool | None = None


@dataclass(frozen=True)
class SamplingPlan:
    """How the sampler generates. backend: [training].rollout_backend, what samples a rollout
    loop's answers (BACKENDS; sampling/backend.py builds it). fast_context, kv_dtype:
    [training].fast_sampling_context and
    kv_dtype (the run file's; a Sampler is also told them per call); packed: packed copies of
    the weights beside the dense cache while sampling; device_sampling, device_logprobs,
    top_p, prefix_cache: RETRO_DEVICE_SAMPLING, RETRO_DEVICE_LOGPROBS, RETRO_FAST_TOP_P,
    RETRO_GENERATION_PREFIX_CACHE."""

    backend: str = "in_process"
    fast_context: bool = True
    kv_dtype: str = "f16"
    packed: bool = True
    device_sampling: bool = True
    device_logprobs: bool = True
    top_p: Literal["candidates_first", "exact"] = "candidates_first"
    prefix_cache: bool = True

    def forward(self, fast: bool, base: ForwardPlan) -> ForwardPlan:
        """The forward plan while this sampler generates over `base`: bf16 products read packed
        weights (the same numbers); float32 ones too in the fast context only (oneDNN's f32
        kernel rounds unlike the plain product, and exact sampling must compute what training
        computes)."""
        packed = {torch.bfloat16} | ({torch.float32} if fast else set()) if self.packed else set()
        return replace(base, fast_decode=fast, packed=frozenset(packed))


@dataclass(frozen=True)
class ComputePlan:
    """Every switch of how this process computes, and where each came from."""

    device: str = "auto"
    dtype: str | None = None  # None: the fast type the device has
    compile: bool = True
    threads: ThreadsPlan = field(default_factory=ThreadsPlan)
    weights: WeightsPlan = field(default_factory=WeightsPlan)
    sampling: SamplingPlan = field(default_factory=SamplingPlan)
    require_gpu_resident: bool = False
    sources: tuple[tuple[str, str], ...] = ()  # (field, "RETRO_THREADS=2" or "[training]...")

    @classmethod
    def of(
        cls,
        env: Environ,
        *,
        device: str = "auto",
        dtype: str | None = None,
        threads: int | None = None,
        cache: str = "auto",
        training=None,
        where: str = "load",
    ) -> ComputePlan:
        """The plan from the environment (`env`, environ.read()), then the caller's values,
        then the defaults. training: a run file's [training] section (threads, the sampling
        context, GPU residency); where: how `sources` names the caller's values ("load" ->
        "load(threads=)", "[training]" -> "[training].threads")."""
        if training is not None:
            threads = training.threads
        if cache not in CACHE_MODES:
            raise ValueError(f"cache = {cache!r}: must be one of {', '.join(CACHE_MODES)}")
        require = env.require_gpu_resident or bool(training and training.require_gpu_resident)
        sources = {
            "threads": _source("RETRO_THREADS", threads is not None, _key(where, "threads")),
            "dtype": _key(where, "dtype") if dtype is not None else environ.setting("RETRO_DTYPE"),
            "cache": _source("RETRO_DEQUANT_CACHE", cache != "auto", _key(where, "cache")),
            "require_gpu_resident": _source(
                "RETRO_REQUIRE_GPU_RESIDENT", require, "[training].require_gpu_resident"
            ),
        }
        for name in SWITCHES:
            sources[name] = environ.setting(name)
        sampling = SamplingPlan(
            backend=training.rollout_backend if training is not None else "in_process",
            fast_context=training.fast_sampling_context if training is not None else True,
            kv_dtype=training.kv_dtype if training is not None else "f16",
            device_sampling=env.device_sampling,
            device_logprobs=env.device_logprobs,
            top_p="candidates_first" if env.fast_top_p else "exact",
            prefix_cache=env.prefix_cache,
        )
        return cls(
            device=device,
            dtype=_dtype_name(dtype if dtype is not None else env.dtype),
            compile=env.compile,
            threads=ThreadsPlan(asked_threads(env.threads, threads), wait=wait_policy()),
            weights=WeightsPlan(cache=env.dequant_cache if env.dequant_cache != "auto" else cache),
            sampling=sampling,
            require_gpu_resident=require,
            sources=tuple((k, v) for k, v in sources.items() if v is not None),
        )

    def forward(self) -> ForwardPlan:
        """The forward plan outside the sampler."""
        return ForwardPlan(compile=self.compile)

    def source(self, name: str) -> str:
        """Where a field's value came from: "RETRO_THREADS=2", "[training].threads", or
        "default"."""
        return dict(self.sources).get(name, "default")


# Variables whose setting the plan's report names beside the switch they flip.
SWITCHES = (
    "RETRO_COMPILE",
    "RETRO_DEVICE_SAMPLING",
    "RETRO_DEVICE_LOGPROBS",
    "RETRO_FAST_TOP_P",
    "RETRO_GENERATION_PREFIX_CACHE",
)


def _source(variable: str, given: bool, key: str) -> str | None:
    """The variable's setting when set, else `key` when the caller gave a value, else None."""
    return environ.setting(variable) or (key if given else None)


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where.startswith("[") else f"{where}({name}=)"


def _dtype_name(dtype) -> str | None:
    """A dtype argument (a torch dtype or a name) as the name the plan prints."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Resolved:
    """What loading decided from a plan on this machine for this model (the loader's report)."""

    plan: ComputePlan
    device: torch.device
    dtype: torch.dtype
    file_bytes: int
    dense_bytes: int  # what a full dense cache of the frozen matmul weights takes
    cache: bool
    cache_reason: str
    threads: int = 0  # intra-op threads in force
    decode_graph: str | None = None  # why decode steps cannot take the graph, None when they can
    int8_bytes: int = 0  # the 8-bit store's size when weights are kept in 8 bits, else 0

    def describe(self) -> str:
        """One line: device, compute type, weights and the dense cache (or the 8-bit store)."""
        gib = 1 << 30
        head = (
            f"device {self.device.type}, compute {str(self.dtype).replace('torch.', '')}, "
            f"weights {self.file_bytes / gib:.2f} GiB as stored, "
        )
        if self.int8_bytes:
            return (
                f"{head}kept in 8 bits ({self.int8_bytes / gib:.2f} GiB; dense cache "
                f"{self.dense_bytes / gib:.2f} GiB; {self.cache_reason})"
            )
        state = "on" if self.cache else "off"
        return (
            f"{head}dequantized-weight cache {state} ({self.dense_bytes / gib:.2f} GiB; "
            f"{self.cache_reason})"
        )

    def lines(self) -> list[str]:
        """The compute plan as a run prints it at its start, each switch with its source."""
        plan, s = self.plan, self.plan.sampling

        def by(name: str) -> str:
            source = plan.source(name)
            return "" if source == "default" else f" ({source})"

        wait = plan.threads.wait or wait_policy()
        graph = "on" if self.decode_graph is None else f"off: {self.decode_graph}"
        compiled = "compiled" if plan.compile else "eager"
        return [
            f"compute: {str(self.dtype).replace('torch.', '')}{by('dtype')}, {self.threads} "
            f"threads{by('threads')}, OpenMP wait {wait}; fused kernels "
            f"{compiled}{by('RETRO_COMPILE')}; decode graph {graph}; products "
            f"{'int8' if self.int8_bytes else plan.weights.products}",
            f"sampling: {s.backend.replace('_', '-')}, "
            f"{'fast' if s.fast_context else 'exact'} context, kv {s.kv_dtype}, "
            f"{'device' if s.device_sampling else 'host'} sampling{by('RETRO_DEVICE_SAMPLING')}, "
            f"{'device' if s.device_logprobs else 'host'} log-probs"
            f"{by('RETRO_DEVICE_LOGPROBS')}, nucleus "
            f"{s.top_p.replace('_', ' ')}{by('RETRO_FAST_TOP_P')}, prefix cache "
            f"{'on' if s.prefix_cache else 'off'}{by('RETRO_GENERATION_PREFIX_CACHE')}",
        ]


_USING: contextvars.ContextVar[ForwardPlan | None] = contextvars.ContextVar(
    "retrograd_forward_plan", default=None
)
_FROM_ENVIRONMENT = {on: ForwardPlan(compile=on) for on in (True, False)}  # read per call
_INSTALLED: list[ComputePlan | None] = [None]
_INSTALLED_FORWARD: list[ForwardPlan | None] = [None]


def install(plan: ComputePlan | None) -> None:
    """This process computes by `plan` from now on (a command's start); None forgets it."""
    _INSTALLED[0] = plan
    _INSTALLED_FORWARD[0] = None if plan is None else plan.forward()


def installed() -> ComputePlan | None:
    return _INSTALLED[0]


def current() -> ForwardPlan:
    """The plan a forward pass computes by: the sampler's overlay, else the installed plan,
    else the environment's (read at each call, as RETRO_COMPILE always was)."""
    plan = _USING.get()
    if plan is not None:
        return plan
    plan = _INSTALLED_FORWARD[0]
    if plan is not None:
        return plan
    return _FROM_ENVIRONMENT[environ.get("RETRO_COMPILE")]


@contextlib.contextmanager
def using(plan: ForwardPlan) -> Iterator[ForwardPlan]:
    """Within this block forward passes compute by `plan` (the sampler's overlay; tests)."""
    token = _USING.set(plan)
    try:
        yield plan
    finally:
        _USING.reset(token)
