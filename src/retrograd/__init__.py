"""Retrograd: fine-tune and reinforcement-train GGUF models as they are.

Public API (docs/python.md): `load` opens a model, `load_tokenizer` a vocabulary alone,
`list_backends` reports the devices and dtypes this process can train on, `Trainer` trains
through the same loops as `retrograd train` (`RolloutGroup`: a caller's own rollouts for its
train_grpo_batch), and the configuration classes (`RunConfig` and one class per table of a run file: `LoraSection`,
`GrpoSection`, ... as `retrograd.config` has them). Importing this package imports nothing
heavy: a name is imported when it is first used (pydantic for the configuration, torch when a
model loads or the backends are listed).
"""

import os as _os

from retrograd.version import __version__ as __version__

# NOTE: PyTorch's CPU allocator backs buffers of 2 MiB and more with transparent huge pages
# when this is set before its first allocation (it reads it once, so importing torch before
# retrograd leaves it off). A decode step reads ~0.5 GiB of dense weights, and 4 KiB pages
# cost it 5-10% in address translation (docs/performance.md). THP_MEM_ALLOC_ENABLE=0 opts out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# NOTE: OpenMP threads that sleep while they wait for each other, rather than spin: beside
# another busy process, spinning waiters burned the cores the late thread needed (an SFT run
# beside one spinning process on 2 cores ran 7.2x slower, not 2x). libgomp reads the policy
# when torch is imported, so it is set here, before anything of ours imports torch; the
# user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (retrograd/threads.py).
from retrograd.threads import apply_wait_policy as _apply_wait_policy  # noqa: E402

_apply_wait_policy()


BACKENDS = ("list_backends", "Backend")
API = ("Trainer", "RolloutGroup")
EAGER = ("__version__", "load", "load_tokenizer")


def __getattr__(name):
    """The names imported when first used: list_backends and Backend, the Trainer and
    RolloutGroup, and the configuration classes of retrograd.config (RunConfig, LoraSection,
    GrpoSection, ...)."""
    if name in BACKENDS:
        import retrograd.model.device as module
    elif name in API:
        import retrograd.api as module
    elif name == "__all__":
        return [*EAGER, *BACKENDS, *API, *_config_names()]
    elif name[:1].isupper() and name in _config_names():
        import retrograd.config as module
    else:
        raise AttributeError(f"module 'retrograd' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__():
    return sorted({*globals(), *BACKENDS, *API, *_config_names()})


def _config_names() -> list[str]:
    import retrograd.config

    return [cls.__name__ for cls in retrograd.config.CLASSES]


def load(path, device="auto", dtype=None, adapter=None, threads=None, cache="auto"):
    from retrograd.trainable.lora import load_adapted

    return load_adapted(path, adapter, device=device, dtype=dtype, threads=threads, cache=cache)


def load_tokenizer(path):
    from retrograd.tokenizer import load_tokenizer as _load_tokenizer

    return _load_tokenizer(path)
