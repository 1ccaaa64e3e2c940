"""What every training run builds before its loop: model, chat format, plan, optimizer, and
the reference model of a KL term or a preference loss.

Functions, not a class hierarchy: each loop calls the ones it needs in the order it reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from retrograd.model.model import Model
from retrograd.tokenizer.conversation import ChatFormat
from retrograd.tokenizer.fallbacks import chat_template
from retrograd.trainable.plan import Trained, TrainPlan

KV_DTYPES = {"f16": torch.float16, "f32": torch.float32}
CKPT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
log = logging.getLogger(__name__)


def load_model(cfg) -> Model:
    """The run's base model on its device, computing by the run's plan (the environment, then
    [model] and [training]: retrograd/compute.py), which this process installs."""
    from retrograd import compute, environ
    from retrograd.model.model import load

    t0 = time.perf_counter()
    plan = compute.ComputePlan.of(
        environ.read(), device=cfg.model.device, training=cfg.training, where="[training]"
    )
    compute.install(plan)
    model = load(cfg.model.path, plan=plan)
    log.info("model loaded in %.2f s", time.perf_counter() - t0)
    return model


def chat_format(model: Model, template_variables: dict | None = None) -> ChatFormat:
    template = chat_template(model.tokenizer, model.gguf.metadata, template_variables or {})
    return ChatFormat(model.tokenizer, template)


def file_chat_format(path, template_variables: dict | None = None) -> ChatFormat:
    """The chat format of the GGUF at `path`, from its metadata alone: data can be tokenized
    and refused before the weights load."""
    from retrograd.gguf import GGUFFile
    from retrograd.tokenizer import Tokenizer

    gguf = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(gguf)
    return ChatFormat(tokenizer, chat_template(tokenizer, gguf.metadata, template_variables or {}))


@dataclass(frozen=True)
class Trainables:
    """What a loop trains and with what: the plan, its Parameters (adapters and base tensors),
    the optimizer over them and the rate its schedule scales."""

    plan: TrainPlan
    trained: Trained
    named: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    rate: float

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named]

    @property
    def adapters(self) -> dict:
        """{base name: LoRA} (empty without an adapter): the switch of the base reference."""
        return self.trained.adapters


def trainables(model: Model, cfg, attached: tuple[TrainPlan, Trained] | None = None) -> Trainables:
    """The run's plan over the loaded model (any [training].trainable mode) and its optimizer;
    `attached`: a plan and its tensors already on the model (a second fit of one model), which
    train on with a fresh optimizer."""
    from retrograd.optim import base_lr, build_optimizer
    from retrograd.trainable.plan import build_plan

    plan, trained = attached if attached is not None else build_plan(model, cfg)
    named = trained.named()
    optimizer = build_optimizer(
        [p for _, p in named], cfg.training, cfg.optimizer, matrices=trained.matrices()
    )
    return Trainables(plan, trained, named, optimizer, base_lr(cfg.training, cfg.optimizer))


def shuffle_seed(cfg) -> int:
    """[lora].seed, which also orders SFT and preference data; its default without [lora]."""
    from retrograd.trainable.plan import LORA_SEED

    return cfg.lora.seed if cfg.lora is not None else LORA_SEED


def apply_memory_knobs(model: Model, training) -> None:
    if training.gradient_checkpointing:
        model.decoder.enable_checkpointing(
            training.checkpoint_every_n_layers, CKPT_DTYPES[training.checkpoint_dtype]
        )


def kv_dtype(model: Model, training) -> torch.dtype:
    """[training].kv_dtype, falling back to float32 where f16 would not match the compute path."""
    if model.dtype == torch.float32:
        return torch.float32
    return KV_DTYPES[training.kv_dtype]


def preflight_check(model: Model, training, console=None) -> None:
    """The preflight audit at the start of a run, on an accelerator (on the CPU nothing can
    fall back). Fallbacks are printed; with require_gpu_resident they stop the run. Sets the
    run's max_gpu_duty_cycle limiter (duty.py) and prints its report when one is requested."""
    from retrograd import environ
    from retrograd.algorithms import duty
    from retrograd.errors import DeviceError
    from retrograd.trainable.preflight import preflight

    limiter = duty.configure(training.max_gpu_duty_cycle, model.device)
    if console is not None and training.max_gpu_duty_cycle < 1.0:
        console.print("; ".join(limiter.report()), markup=False, highlight=False)
    strict = training.require_gpu_resident or environ.get("RETRO_REQUIRE_GPU_RESIDENT")
    if model.device.type == "cpu":
        if strict:
            raise DeviceError(
                "[training].require_gpu_resident = true: the run is on the CPU (no GPU, or "
                "device = cpu); every operation would run there. Use a GPU or remove the key"
            )
        return
    report = preflight(model.decoder, ["auto"])
    if not report.problems:
        return
    listed = ", ".join(report.problems)
    if strict:
        raise DeviceError(
            f"[training].require_gpu_resident: operations off {model.device.type}: {listed}"
        )
    if console is not None:
        console.print(
            f"[yellow]preflight[/]: operations fall back off {model.device.type}: {listed}"
        )


def rollout_backend(run, concurrency: int):
    """An opened run's rollout backend ([training].rollout_backend: sampling/backend.py), told
    of each new policy by the loop and closed with the run; `concurrency`: the loop's answers
    sampled at once."""
    from retrograd.sampling.backend import rollout_backend as backend_of

    backend = backend_of(run.model, run.cfg.training, concurrency, run.tr.adapters)
    run.closing.callback(backend.close)
    return backend


def check_fanout(training, algorithm: str) -> None:
    """[training].shared_prefix_fanout values the rollout loops (ppo, grpo, on-policy distill,
    agent_grpo) cannot honour yet, refused before anything loads, naming the key
    (docs/configuration.md, "At run time"). What the world cannot run is the algorithm
    table's check (table.check_world)."""
    from retrograd.errors import ConfigError

    if training.shared_prefix_fanout not in ("auto", "off"):
        raise ConfigError(
            f"[training].shared_prefix_fanout = {training.shared_prefix_fanout!r}: not "
            f"available in this version ({algorithm} packs as many answers of a group as fit "
            "micro_batch; use auto or off)"
        )


def check_same_tokenizer(model: Model, other: Model, where: str) -> None:
    """A reference or teacher must read and write the same token ids as the trained model."""
    from retrograd.errors import ConfigError

    keys = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
    for key in keys:
        if model.gguf.get(key) != other.gguf.get(key):
            raise ConfigError(
                f"{where} = {other.gguf.path}: its tokenizer differs from the model's "
                f"({key}); the reference must share the model's vocabulary"
            )


# -- the reference model -------------------------------------------------------------------


def reference(cfg, model: Model, adapters):
    """A factory of contexts giving the reference decoder: None (the policy's own decoder with
    its adapters off, no second copy of the weights) or [reference].model's, loaded here."""
    if cfg.reference is None:
        return lambda: _Off(adapters)
    from retrograd.model.model import load

    ref = load(cfg.reference.model, device=cfg.model.device, threads=cfg.training.threads)
    check_same_tokenizer(model, ref, "[reference].model")
    return lambda: _Same(ref.decoder)


def reference_id(cfg) -> str | None:
    """The content fingerprint of [reference].model: a resumed run must score against it."""
    if cfg.reference is None:
        return None
    from retrograd.checkpoint import model_identity

    return model_identity(cfg.reference.model).fingerprint


class _Off:
    def __init__(self, adapters):
        from retrograd.trainable.lora import adapters_off

        self.cm = adapters_off(adapters)

    def __enter__(self):
        self.cm.__enter__()
        return None

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


class _Same:
    def __init__(self, decoder):
        self.decoder = decoder

    def __enter__(self):
        return self.decoder

    def __exit__(self, *exc):
        return False
