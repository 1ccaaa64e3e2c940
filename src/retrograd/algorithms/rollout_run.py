"""The frame the prompt-driven reward loops (ppo, grpo) share around their updates: what is
built and checked before the first one, the sinks' start, the result record, the held-out
measure, and the export and summary after the last one. agent_grpo (whose rollouts act on
scenarios in an arena) and on-policy distillation build their own frames; agent_grpo shares
`open_observe`.

It reads the shared sections ([training], [lora], [evaluation], [output]) and the prompt file
the loop names; the loop keeps its own section, its phases, its positions and its settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from retrograd.algorithms import context, persist
from retrograd.algorithms.evaluate import first_last
from retrograd.checkpoint import outputs
from retrograd.data.prompts import read_prompts, render_prompts
from retrograd.sampling.backend import RolloutBackend, rollout_backend


@dataclass
class RolloutResult:
    output: Path
    updates: int
    global_step: int
    stopped: str | None  # why the run stopped before its last update, if it did
    seconds: float
    rewards: list[float] = field(default_factory=list)  # mean reward of each update
    evals: list[tuple[int, float]] = field(default_factory=list)
    best_eval: float | None = None


@dataclass
class Built:
    """What a rollout loop trains with: model, prompts, plan, optimizer, rollout backend."""

    model: object
    prompt_file: object
    held_file: object | None
    prompts: list
    held: list | None
    plan: object
    adapters: dict
    named: list
    params: list
    optimizer: object
    rate: float
    backend: RolloutBackend
    trained: object = None  # trainable.plan.Trained: adapters and base tensors, for the export

    @property
    def fingerprints(self) -> dict:
        return {
            "prompts": self.prompt_file.fingerprint,
            "eval": self.held_file.fingerprint if self.held_file else None,
        }


def build(cfg, prompts_path, where: str, sinks, run_file, concurrency: int) -> Built:
    """Everything that can be checked is checked before the model loads; then the model, the
    rendered prompts, the plan (any trainable mode), the optimizer and the rollout backend
    ([training].rollout_backend's, sampling/backend.py). `where`
    names the prompts key in errors ("[ppo].prompts"); `concurrency`, the loop's answers
    generated at once, raises the derived generation batch (context.generation_batch)."""
    training = cfg.training
    outputs.check_outputs(cfg, run_file)
    prompt_file = read_prompts(prompts_path, where)
    held_file = read_prompts(cfg.evaluation.data, "[evaluation].data") if cfg.evaluation else None
    model = context.load_model(cfg)
    context.preflight_check(model, training, getattr(sinks, "console", None))
    context.apply_memory_knobs(model, training)
    chat = context.chat_format(model)
    prompts = render_prompts(prompt_file, chat, training.ctx)
    held = render_prompts(held_file, chat, training.ctx) if held_file else None
    tr = context.trainables(model, cfg)  # any [training].trainable mode
    backend = rollout_backend(model, training, concurrency, tr.adapters)
    return Built(
        model, prompt_file, held_file, prompts, held, tr.plan, tr.adapters, tr.named, tr.params,
        tr.optimizer, tr.rate, backend, tr.trained,
    )  # fmt: skip


def sampler_identity(training) -> dict:
    """What of [training] changes the answers a resumed run samples: the sampling context, and
    the rollout backend with its importance-weight cap when it is not the default (so the
    checkpoints of in-process runs keep their identity)."""
    out = {"fast_sampling_context": training.fast_sampling_context}
    if training.rollout_backend != "in_process":
        out |= {"rollout_backend": training.rollout_backend, "is_cap": training.rollout_is_cap}
    return out


def open_observe(cfg, algorithm: str, settings: dict, update: int, found, sinks, world=None):
    """The run's [observe] writer (None without the section, and on every rank but rank 0 of a
    distributed run), told the update a resumed run continues after."""
    from retrograd.observe.rollouts import ObserveWriter

    if world is not None and not world.main:
        return None

    return ObserveWriter.open(
        cfg.observe,
        algorithm=algorithm,
        model=cfg.model.path,
        params=settings,
        resumed_from_update=update if found is not None else None,
        console=getattr(sinks, "console", None),
    )


def start(sinks, cfg, b: Built, updates: int, pos, found) -> None:
    """The plan on the terminal and the sinks open, counting updates from `pos.update`."""
    prompts, held = b.prompt_file, b.held_file
    sinks.start(
        cfg,
        b.model,
        b.plan,
        updates,  # the bar counts updates: one without signal makes no optimizer step
        data=(prompts.path, f"{prompts.path.name}: {len(b.prompts)} prompts"),
        held=(held.path, f"{held.path.name}: {len(b.held)} prompts") if held else None,
        iterations=updates,
        initial_step=pos.global_step,
        unit="update",
        initial_position=pos.update,
    )
    if found is not None:
        sinks.resumed(found[1], pos.global_step)


def finish(
    cfg, b: Built, run_file, run, mark, patience, steps: int, result: RolloutResult, started, sinks
) -> RolloutResult:
    """Export the result (kept elsewhere if that fails, and the error says where), fill the
    result and print the summary."""
    persist.export_or_keep(
        cfg, b.model, run_file, run, mark, b.named, b.optimizer, b.plan, b.trained, patience, steps
    )
    result.updates, result.global_step = mark.update, mark.global_step
    result.best_eval = -patience.best if patience.best != float("inf") else None
    result.seconds = time.perf_counter() - started
    sinks.finish(
        {
            cfg.output.kind or "adapter": str(result.output),
            "mean reward, first -> last update": first_last(result.rewards),
            "stopped early": result.stopped or "no",
        }
    )
    return result


def measure(cfg, generator, program, held) -> dict | None:
    """The held-out rewards of a PPO or GRPO run with the weights as they are (None without
    [evaluation]), for a client's question to a served run; patience is not told."""
    from retrograd.algorithms.evaluate import held_out_rewards, reward_summary
    from retrograd.rollout.sample import held_out

    if held is None:
        return None
    prompts = held_out(held, cfg.evaluation.max_examples)
    sampling = getattr(cfg, cfg.run.algorithm).sampling
    return reward_summary(held_out_rewards(generator, program, prompts, sampling)[0])
