"""Which weights `chat` and `serve` answer with, loaded once with everything they need.

The adapter is the one the run file trains ([output].path when output.kind is adapter) unless
--adapter, --checkpoint (the adapter exported beside a .state directory) or --base-only says
otherwise. The base model and the adapter share one loaded model: switching between them
turns the LoRA modules off and on, so no weights are reloaded. Knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrograd.errors import ConfigError

DEFAULT_CTX = 4096  # chat and serve context when --ctx is not given (capped by the model's)


def configured_adapter(cfg) -> Path | None:
    """The adapter the run file trains, or None when its output is not an adapter."""
    kind = cfg.output.kind or ("adapter" if cfg.training.trainable == "lora" else "trainable")
    return Path(cfg.output.path) if kind == "adapter" else None


def checkpoint_adapter(checkpoint: str | Path) -> Path:
    """DIR/best.state -> DIR/best.gguf (the adapter exported beside the checkpoint)."""
    path = Path(str(checkpoint).rstrip("/"))
    if path.suffix != ".state":
        raise ConfigError(f"--checkpoint {checkpoint}: expected a .state directory")
    return path.with_suffix(".gguf")


def resolve_adapter(
    cfg, adapter: str | None = None, checkpoint: str | None = None, base_only: bool = False
) -> Path | None:
    """The adapter file to apply, or None for the base model; a missing file is a ConfigError."""
    chosen = [flag for flag, v in (("--adapter", adapter), ("--checkpoint", checkpoint)) if v]
    if base_only:
        chosen.append("--base-only")
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)}: choose one")
    if base_only:
        return None
    if adapter:
        path, origin = Path(adapter), "--adapter"
    elif checkpoint:
        path, origin = checkpoint_adapter(checkpoint), f"--checkpoint {checkpoint}"
    else:
        path = configured_adapter(cfg)
        if path is None:
            raise ConfigError(
                "[output].kind is not adapter: pass --adapter ADAPTER.gguf or --base-only"
            )
        origin = "[output].path"
    if not path.is_file():
        raise ConfigError(
            f"{origin}: adapter {path} does not exist (train first, or pass --adapter or "
            "--base-only)"
        )
    return path


def set_adapter(decoder, enabled: bool) -> None:
    """Turn every LoRA module of the decoder on (the adapter) or off (the base model)."""
    for module in decoder.modules():
        lora = getattr(module, "lora", None)
        if lora is not None:
            lora.enabled = enabled


@dataclass
class Loaded:
    """A model ready to generate: the model, its chat format, a sampler, its context."""

    model: object
    chat: object  # retrograd.tokenizer.ChatFormat
    sampler: object  # retrograd.sampling.Sampler
    ctx: int
    adapter: Path | None


def load_for_generation(cfg, adapter: Path | None, ctx: int | None, device: str | None) -> Loaded:
    """Load the model (with the adapter), its chat template and a sampler for chat and serve."""
    from retrograd.sampling import Sampler
    from retrograd.sampling.engine import run_settings
    from retrograd.tokenizer import ChatFormat, chat_template
    from retrograd.trainable.lora import load_adapted

    if ctx is not None and ctx < 2:
        raise ConfigError(f"--ctx {ctx}: must be at least 2")
    model = load_adapted(
        cfg.model.path,
        adapter,
        device=device or cfg.model.device,
        threads=cfg.training.threads,
    )
    section = cfg.algorithm_section
    variables = getattr(section, "template_variables", None) or None
    template = chat_template(model.tokenizer, model.gguf.metadata, variables)
    ctx = ctx or min(DEFAULT_CTX, model.config.n_ctx_train or DEFAULT_CTX)
    sampler = Sampler(model.decoder, model.tokenizer, max_len=ctx, **run_settings(cfg.training))
    return Loaded(model, ChatFormat(model.tokenizer, template), sampler, ctx, adapter)
