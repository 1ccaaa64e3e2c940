"""`retrograd.Trainer`: a model held between fits, trained through the same loops as
`retrograd train`.

The Trainer keeps the sections that shape every fit ([model], [lora], [trainable],
[training], [optimizer], [reference], a default [output]); each fit_* adds its algorithm's
section and the run's own ([output], [evaluation], [checkpoint], [metrics], [observe]), builds
the RunConfig a run file would give (config.build_run: the same checks, the same error lines),
and runs the algorithm table's loop (algorithms/table.py) through a Door that carries the
loaded model, the tensors trained so far, Python reward functions, an agent environment and
verify function, and the caller's callbacks. A fit's adapter is the one `retrograd train`
writes from the equivalent run file, byte for byte.

Knows the configuration, the algorithm table, the door and the export; no loop's math.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.checkpoint.outputs import check_output_file, run_inputs
from retrograd.config import RunConfig, build_run, check_sections
from retrograd.config.document import ALGORITHM_SECTIONS
from retrograd.errors import ConfigError, TrainingError

# the Trainer's own sections: every fit reads them
TRAINER_SECTIONS = ("model", "lora", "trainable", "training", "optimizer", "reference")
# a fit's own sections besides its algorithm's
RUN_SECTIONS = ("output", "evaluation", "checkpoint", "metrics", "observe")
# [training] keys the loaded model and its trained tensors were built by: a fit's own
# [training] may change every other key
FIXED_TRAINING = (
    "trainable",
    "master_weights",
    "threads",
    "rollout_backend",
    "fast_sampling_context",
    "kv_dtype",
    "require_gpu_resident",
    "gradient_checkpointing",
    "checkpoint_every_n_layers",
    "checkpoint_dtype",
)
FIT_METHODS = {
    "sft": "fit_sft",
    "ppo": "fit_ppo",
    "grpo": "fit_grpo",
    "distill": "fit_distill",
    "preference": "fit_preference",
    "agent_grpo": "fit_agentic_grpo",
}


def list_backends():
    """The devices and dtypes this process can train on (model/device.py's list_backends)."""
    from retrograd.model.device import list_backends as backends

    return backends()


@dataclass(frozen=True)
class _Base:
    """The Trainer's sections as the model loader and the plan builder read a run's."""

    model: Any
    training: Any
    lora: Any
    trainable: Any
    optimizer: Any
    reference: Any


class Trainer:
    """Train a GGUF model from Python: the run file's sections as arguments, each algorithm
    a `fit_*` method, the same loops, checks and outputs as `retrograd train`.

        with retrograd.Trainer("model.gguf", device="cpu", lora=LoraSection(rank=8),
                               training=TrainingSection(lr=1e-3, ctx=128)) as trainer:
            trainer.fit_sft(SftSection(data="chat.jsonl"), output="out/sft.gguf")
            trainer.fit_grpo(grpo, rewards=[my_reward])
            trainer.save_adapter("out/adapter.gguf")

    `model` is the GGUF's path (or a ModelSection or dict); `device` is [model].device (auto,
    cpu, gpu). `lora`, `trainable`, `training`, `optimizer`, `reference` and `output` are the
    run file's tables of those names, as section objects (retrograd.LoraSection, ...) or
    dicts, checked when the Trainer is made: a problem raises ConfigError naming the key as
    the run file does (`[lora].rank = 0: must be at least 1`), and the rules between
    sections apply at each fit, as `retrograd train` applies them to a file. `lora` defaults
    to LoraSection() when training.trainable is lora (the default) or hybrid. `output` is
    where a fit writes its result unless the fit names one; left out, a file in a temporary
    folder removed on close (keep it with `save_adapter`). `progress`: print the run's
    progress and summary as `retrograd train` does. `on_step`, `on_update`, `on_evaluate`:
    callbacks of every fit (see fit_sft).

    The model loads on first use and stays loaded; the trained tensors (an adapter, or base
    tensors) stay on it from one fit to the next, each fit with a fresh optimizer. A context
    manager: leaving the `with` block (or `close()`) frees the model and the temporary folder.
    """

    def __init__(
        self,
        model: str | Path | Any,
        *,
        device: str | None = None,
        lora: Any = None,
        trainable: Any = None,
        training: Any = None,
        optimizer: Any = None,
        reference: Any = None,
        output: str | Path | Any = None,
        progress: bool = True,
        on_step: Callable | None = None,
        on_update: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> None:
        given = {
            "model": _model_table(model, device),
            "lora": lora,
            "trainable": trainable,
            "training": training,
            "optimizer": optimizer,
            "reference": reference,
            "output": _output_table(output),
        }
        self._sections = check_sections({k: v for k, v in given.items() if v is not None})
        mode = self._sections["training"].trainable if "training" in self._sections else "lora"
        if lora is None and mode in ("lora", "hybrid"):
            self._sections["lora"] = check_sections({"lora": {}})["lora"]
        self.progress = progress
        self._hooks = (on_step, on_update, on_evaluate)
        self._file: RunConfig | None = None  # from_toml's run
        self._run_file: Path | None = None
        self._config: RunConfig | None = None
        self._model = None
        self._trained = None  # (TrainPlan, Trained) on the model
        self._batch = None  # the opened frame of train_grpo_batch
        self._grpo = None  # the last fit_grpo's [grpo], the batches' loss settings
        self._tmp: Path | None = None
        self._closed = False

    @classmethod
    def from_toml(
        cls,
        path: str | Path,
        *,
        model: str | Path | None = None,
        device: str | None = None,
        progress: bool = True,
    ) -> Trainer:
        """A Trainer of a run file's sections (read and checked as `retrograd train` reads it;
        `model` and `device` as its --model and --device). `fit()` then runs the file as
        `retrograd train` does, and `trainer.config.to_toml()` writes it back."""
        cfg = RunConfig.from_toml(path, model=model, device=device)
        trainer = cls(
            cfg.model,
            **{name: getattr(cfg, name) for name in TRAINER_SECTIONS[1:]},
            output=cfg.output,
            progress=progress,
        )
        if cfg.lora is None:
            trainer._sections.pop("lora", None)
        trainer._file = trainer._config = cfg
        trainer._run_file = Path(path)
        return trainer

    # -- the context manager --------------------------------------------------------------

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the model and the trained tensors, and remove the temporary output folder."""
        self._end_batch()
        self._model = self._trained = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._closed = True

    # -- what the Trainer holds -----------------------------------------------------------

    @property
    def config(self) -> RunConfig | None:
        """The RunConfig of the last fit (or of the run file, from `from_toml`): `config.
        to_toml(path)` writes the run file `retrograd train` reads to repeat it. None before
        any fit of a Trainer built in Python. A fit given reward functions, an environment or
        a verify function has no complete run file: those are objects, not keys."""
        return self._config

    @property
    def model(self):
        """The loaded model (retrograd.load's Model), with the trained tensors on it; loaded
        on first use, on [model].device, computing as [training] says."""
        self._check_open()
        if self._model is None:
            from retrograd.algorithms import context

            self._model = context.load_model(self._base())
        return self._model

    def _base(self, training: Any = None) -> _Base:
        s = self._sections
        t = training or s.get("training") or check_sections({"training": {}})["training"]
        return _Base(
            s["model"], t, s.get("lora"), s.get("trainable"), s.get("optimizer"), s.get("reference")
        )

    def _plan(self, cfg: Any = None):
        """(TrainPlan, Trained): the tensors the fits train, attached to the model when first
        needed (the same plan, from the same seed, as a run's)."""
        if self._trained is None:
            from retrograd.trainable.plan import build_plan

            self._trained = build_plan(self.model, cfg or self._base())
        return self._trained

    # -- the fits -------------------------------------------------------------------------

    def fit(self, *, resume: str | bool | None = None) -> dict[str, object]:
        """Run the run file of `from_toml` as `retrograd train` does (`resume` as its
        --resume) -> the run's summary."""
        if self._file is None:
            raise ConfigError("fit(): no run file; use Trainer.from_toml, or a fit_* method")
        return getattr(self, FIT_METHODS[self._file.run.algorithm])(resume=resume)

    def fit_sft(
        self,
        sft: Any = None,
        *,
        output: str | Path | Any = None,
        evaluation: Any = None,
        checkpoint: Any = None,
        metrics: Any = None,
        training: Any = None,
        resume: str | bool | None = None,
        on_step: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> dict[str, object]:
        """Supervised fine-tuning ([sft]: an SftSection or dict; docs/sft.md) -> the run's
        summary (`output`, `global_step`, `iterations`, `stopped`, `seconds`, `tokens`,
        `best_eval`, `last_loss`).

        Every fit takes the command line's run settings: `output` (a path, or an
        OutputSection: where the result is written; the Trainer's by default),
        `evaluation`, `checkpoint` and `metrics` (the [evaluation], [checkpoint] and
        [metrics] tables), `training` (this fit's [training], replacing the Trainer's; keys
        the model was loaded by, such as threads or kv_dtype, must stay), `resume` (True:
        the latest checkpoint of [checkpoint].directory, or a checkpoint's path, as
        `retrograd train --resume`). The rollout fits add `observe` ([observe]) and
        `on_update`.

        Callbacks: `on_step(event)` after each optimizer step (an update's, in rollout
        fits) with its global_step, iteration, values, tokens and seconds; `on_update(event)`
        after a rollout update, with its `groups` (the rollout records: answers, rewards,
        advantages); `on_evaluate(event)` after each scheduled evaluation, with its values
        and whether it improved. A callback that returns a true value ends the run there,
        gracefully: the summary says `stopped = "callback"`, and the result is exported as
        at any end. An exception in a callback fails the fit. Given here, they replace the
        Trainer's."""
        return self._fit(
            "sft", sft, output=output, evaluation=evaluation, checkpoint=checkpoint,
            metrics=metrics, training=training, resume=resume, on_step=on_step,
            on_evaluate=on_evaluate,
        )  # fmt: skip

    def fit_grpo(
        self,
        grpo: Any = None,
        *,
        rewards: Sequence[Callable] = (),
        reward_weights: Sequence[float] | None = None,
        output: str | Path | Any = None,
        evaluation: Any = None,
        checkpoint: Any = None,
        metrics: Any = None,
        observe: Any = None,
        training: Any = None,
        resume: str | bool | None = None,
        on_step: Callable | None = None,
        on_update: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> dict[str, object]:
        """GRPO ([grpo]: a GrpoSection or dict; docs/grpo.md) -> the run's summary.

        `rewards`: Python reward functions in TRL's shape, `fn(prompts, completions,
        **columns) -> [float, ...]` (docs/python.md, "Rewards as Python functions"), summed
        with `reward_weights` (1 each by default) and with [grpo].reward_command's program
        when it is set; with functions, reward_command may be left out. A judge
        ([grpo].judge) adds its verdict as in a run file. A function that raises or returns
        NaN fails the batch as a failing reward program does (a RewardError naming it). The
        other settings and callbacks are fit_sft's."""
        return self._fit(
            "grpo", grpo, rewards=rewards, reward_weights=reward_weights, output=output,
            evaluation=evaluation, checkpoint=checkpoint, metrics=metrics, observe=observe,
            training=training, resume=resume, on_step=on_step, on_update=on_update,
            on_evaluate=on_evaluate,
        )  # fmt: skip

    def fit_ppo(
        self,
        ppo: Any = None,
        *,
        rewards: Sequence[Callable] = (),
        reward_weights: Sequence[float] | None = None,
        output: str | Path | Any = None,
        evaluation: Any = None,
        checkpoint: Any = None,
        metrics: Any = None,
        observe: Any = None,
        training: Any = None,
        resume: str | bool | None = None,
        on_step: Callable | None = None,
        on_update: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> dict[str, object]:
        """PPO ([ppo]: a PpoSection or dict; docs/ppo.md) -> the run's summary. `rewards`
        and `reward_weights` as fit_grpo's; the other settings and callbacks are
        fit_sft's."""
        return self._fit(
            "ppo", ppo, rewards=rewards, reward_weights=reward_weights, output=output,
            evaluation=evaluation, checkpoint=checkpoint, metrics=metrics, observe=observe,
            training=training, resume=resume, on_step=on_step, on_update=on_update,
            on_evaluate=on_evaluate,
        )  # fmt: skip

    def fit_preference(
        self,
        preference: Any = None,
        *,
        output: str | Path | Any = None,
        evaluation: Any = None,
        checkpoint: Any = None,
        metrics: Any = None,
        training: Any = None,
        resume: str | bool | None = None,
        on_step: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> dict[str, object]:
        """Preference optimisation, dpo, ipo, simpo or orpo ([preference]: a
        PreferenceSection or dict; docs/preference.md) -> the run's summary. A dpo or ipo
        loss compares against the Trainer's `reference` (or the model with the adapter off).
        The settings and callbacks are fit_sft's."""
        return self._fit(
            "preference", preference, output=output, evaluation=evaluation,
            checkpoint=checkpoint, metrics=metrics, training=training, resume=resume,
            on_step=on_step, on_evaluate=on_evaluate,
        )  # fmt: skip

    def fit_distill(
        self,
        distill: Any = None,
        *,
        output: str | Path | Any = None,
        evaluation: Any = None,
        checkpoint: Any = None,
        metrics: Any = None,
        training: Any = None,
        resume: str | bool | None = None,
        on_step: Callable | None = None,
        on_update: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> dict[str, object]:
        """Distillation from a teacher ([distill]: a DistillOnPolicy or DistillOffline or a
        dict with its `mode`; docs/distill.md) -> the run's summary. The settings and
        callbacks are fit_sft's (`on_update` for on_policy)."""
        return self._fit(
            "distill", distill, output=output, evaluation=evaluation, checkpoint=checkpoint,
            metrics=metrics, training=training, resume=resume, on_step=on_step,
            on_update=on_update, on_evaluate=on_evaluate,
        )  # fmt: skip

    def fit_agentic_grpo(
        self,
        agent: Any = None,
        *,
        environment: Any = None,
        verify: Callable | None = None,
        output: str | Path | Any = None,
        evaluation: Any = None,
        checkpoint: Any = None,
        metrics: Any = None,
        observe: Any = None,
        training: Any = None,
        resume: str | bool | None = None,
        on_step: Callable | None = None,
        on_update: Callable | None = None,
        on_evaluate: Callable | None = None,
    ) -> dict[str, object]:
        """Agentic GRPO, multi-turn episodes with tools ([agent]: an AgentSection or dict;
        docs/agent.md) -> the run's summary.

        `environment`: a Python environment (retrograd.agent.types.Environment, or any
        object with its methods) in place of [agent.environment]; `verify`: a function
        grading each finished episode, `verify(request) -> float | bool | Verification |
        None` (docs/python.md, "Environments and verify functions in Python"). What either
        raises fails that trajectory as a failing environment does, never the run (until
        more than [agent].max_dropped_fraction of an update is lost). The other settings
        and callbacks are fit_sft's."""
        return self._fit(
            "agent_grpo", agent, environment=environment, verify=verify, output=output,
            evaluation=evaluation, checkpoint=checkpoint, metrics=metrics, observe=observe,
            training=training, resume=resume, on_step=on_step, on_update=on_update,
            on_evaluate=on_evaluate,
        )  # fmt: skip

    def _fit(
        self,
        algorithm: str,
        section: Any,
        *,
        resume: str | bool | None = None,
        training: Any = None,
        rewards: Iterable[Callable] = (),
        reward_weights: Sequence[float] | None = None,
        environment: Any = None,
        verify: Callable | None = None,
        on_step: Callable | None = None,
        on_update: Callable | None = None,
        on_evaluate: Callable | None = None,
        **run: Any,
    ) -> dict[str, object]:
        """One fit: its RunConfig (build_run: a run file's checks), the loop the table picks,
        through a Door carrying the loaded model and what Python supplies."""
        from retrograd.algorithms import table
        from retrograd.algorithms.door import Door, Hooks

        self._check_open()
        self._end_batch()
        rewards = tuple(rewards or ())
        if isinstance(rewards, str) or not all(callable(f) for f in rewards):
            raise ConfigError("rewards: give a list of reward functions (callables)")
        supplied = [
            part
            for part, given in (
                ("rewards", rewards),
                ("environment", environment),
                ("verify", verify),
            )
            if given
        ]
        cfg = build_run(self._run_sections(algorithm, section, training, run), supplied=supplied)
        self._check_training(cfg.training)
        self._config = cfg
        if algorithm == "grpo":
            self._grpo = cfg.grpo
        defaults = self._hooks
        hooks = Hooks(on_step or defaults[0], on_update or defaults[1], on_evaluate or defaults[2])
        weights = tuple(reward_weights) if reward_weights is not None else None
        sinks = self._sinks()
        door = Door(
            sinks, hooks=hooks, resume=resume, run_file=self._run_file, model=self.model,
            trained=self._plan(cfg), rewards=rewards, reward_weights=weights,
            environment=environment, verify=verify,
        )  # fmt: skip
        try:
            return table.run(cfg, door).summary()
        except BaseException as error:  # the metric sinks record the failure, as the CLI's do
            sinks.fail(f"{type(error).__name__}: {error}")
            raise

    def _run_sections(
        self, algorithm: str, section: Any, training: Any, run: dict[str, Any]
    ) -> dict[str, Any]:
        """The fit's run document: [run], the Trainer's sections, the fit's own (the run
        file's where the fit leaves one out and the file runs this algorithm)."""
        name = ALGORITHM_SECTIONS[algorithm]
        file = self._file if self._file is not None and self._file.algorithm == algorithm else None
        if section is None:
            if file is None:
                raise ConfigError(
                    f"[{name}]: required by {FIT_METHODS[algorithm]}: give its section "
                    "(a section object or a dict)"
                )
            section = getattr(file, name)
        sections: dict[str, Any] = dict(self._sections)
        sections["run"] = file.run if file is not None else {"algorithm": algorithm}
        sections[name] = section
        if training is not None:
            sections["training"] = training
        for key in RUN_SECTIONS:
            value = run.get(key)
            if key == "output":
                value = _output_table(value)
            if value is None and file is not None:
                value = getattr(file, key)
            if value is not None:
                sections[key] = value
        sections.setdefault("output", self._default_output())
        return sections

    def _default_output(self) -> dict[str, str]:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="retrograd-trainer-"))
        return {"path": str(self._tmp / "adapter.gguf")}

    def _check_training(self, training) -> None:
        """A fit's [training] keeps the keys the model and its trained tensors were built by."""
        from retrograd.config.report import toml_value

        mine = self._base().training
        for key in FIXED_TRAINING:
            have, want = getattr(training, key), getattr(mine, key)
            if have != want:
                raise ConfigError(
                    f"[training].{key} = {toml_value(have)}: the Trainer's model and trained "
                    f"tensors were made with {toml_value(want)}; give it to "
                    "Trainer(training=...) instead"
                )

    def _sinks(self):
        from retrograd.observe.sinks import Sinks

        if not self.progress:
            return Sinks.quiet()
        from rich.console import Console

        return Sinks(console=Console())

    # -- a caller's own rollouts ----------------------------------------------------------

    def train_grpo_batch(self, groups: Sequence, *, grpo: Any = None) -> dict[str, float]:
        """One GRPO update on groups sampled anywhere (another engine, a simulator) -> the
        update's values (reward/mean, train/loss, policy/..., docs/metrics.md).

        `groups`: RolloutGroup(prompt_ids, completions, rewards, logprobs=None) or plain
        tuples of those fields: each prompt's rendered ids, its answers' ids, one reward an
        answer, and optionally each answer's per-token log-probabilities under the policy
        that sampled it. With them, each token's term is weighted by the truncated
        importance ratio min(pi_old / pi_behaviour, [training].rollout_is_cap); without,
        the answers count as sampled by these weights (ratio 1), as in a run.

        The loss settings are [grpo]'s: `grpo` (a GrpoSection, or a dict of [grpo] keys:
        grpo_epochs, clip_range_low/high, kl_coefficient, baseline, importance_sampling_level,
        kl_schedule, ...; the keys a batch never reads, such as prompts and sampling, may be
        left out), else the last fit_grpo's [grpo], else GRPO's usual values (one pass, clip
        0.2 / 0.28, no KL). As in a run: advantages are the reward minus the group's
        baseline, a group whose rewards are all equal does not train, each of the grpo_epochs
        passes is one optimizer step, the learning rate schedule counts [grpo].updates x
        grpo_epochs steps (a decaying schedule needs `updates`, the batches it spans, and
        refuses a batch past them). Successive calls share one optimizer and step count
        until a fit or `close`; the Trainer's on_step and on_update see each batch. Bad
        input raises ConfigError naming the place (`groups[1].rewards[2] = nan: must be a
        finite number`)."""
        from retrograd.algorithms.door import Door, Hooks
        from retrograd.api.batch import BatchRun, batch_grpo

        self._check_open()
        given = grpo if grpo is not None else self._grpo
        section = batch_grpo(given or {})
        if self._batch is None or self._batch[0] != section:
            self._end_batch()
            sections = {**self._sections, "run": {"algorithm": "grpo"}, "grpo": section}
            sections.setdefault("output", self._default_output())
            cfg = build_run(sections, supplied=("rewards",))
            schedule = cfg.training.lr_scheduler
            if (
                schedule != "constant"
                and isinstance(section, dict)
                and "updates" not in (given or {})
            ):
                raise ConfigError(
                    f'[training].lr_scheduler = "{schedule}": the schedule spans [grpo].updates '
                    'x grpo_epochs steps; give train_grpo_batch(grpo={..., "updates": N}) '
                    "with N the batches to come"
                )
            door = Door(
                self._sinks(), hooks=Hooks(*self._hooks), model=self.model,
                trained=self._plan(cfg),
            )  # fmt: skip
            self._batch = (section, BatchRun.open(cfg, door))
        return self._batch[1].step(groups)

    def _end_batch(self) -> None:
        if self._batch is not None:
            self._batch[1].close()
            self._batch = None

    # -- the trained model ----------------------------------------------------------------

    def save_adapter(self, path: str | Path) -> Path:
        """Write the trained adapter as a llama.cpp LoRA GGUF at `path` (through a temporary
        name and a rename) -> the path. The adapter is [lora]'s as trained so far (its
        initial weights before any fit); training.trainable full or partial has none (use
        `save`). A path that is the model, a file the last fit read, or a folder is refused
        (ConfigError) before anything is written."""
        trained = self._plan()
        if trained[0].mode not in ("lora", "hybrid"):
            raise TrainingError(
                f"save_adapter: training.trainable = {trained[0].mode!r} trains no adapter; "
                "save(path) writes the trained tensors"
            )
        return self._export(path, "adapter")

    def save(self, path: str | Path, kind: str | None = None) -> Path:
        """Write the trained result at `path` as [output].kind says: `adapter`, `trainable`
        (the trained base tensors) or `model` (a whole GGUF); by default the kind a run of
        this training.trainable writes. -> the path."""
        from retrograd.config.rules_train import OUTPUT_KINDS

        mode = self._plan()[0].mode
        kind = kind or OUTPUT_KINDS[mode][0]
        if kind not in OUTPUT_KINDS[mode]:
            raise ConfigError(
                f"[output].kind = {kind!r}: training.trainable = {mode!r} writes "
                f"{' or '.join(OUTPUT_KINDS[mode])}"
            )
        return self._export(path, kind)

    def _export(self, path: str | Path, kind: str) -> Path:
        from retrograd.checkpoint.export import export_output

        plan, trained = self._plan()
        check_output_file(f"save({kind!r}):", Path(path), self._inputs())
        output = check_sections({"output": {"path": str(path), "kind": kind}})["output"]
        return export_output(_Output(output), self.model, plan, trained, Path(path))

    def _inputs(self) -> dict[str, Path]:
        """{where: path} of what this Trainer reads: the model and the last fit's inputs."""
        found = {"the model ([model].path)": Path(self._sections["model"].path)}
        if self._config is not None:
            found |= run_inputs(self._config, self._run_file)
        return found

    def generate(
        self,
        prompt: str | Sequence[dict] | Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Sequence[str] = (),
    ) -> str:
        """The model's answer, with the trained tensors as they are now. `prompt`: a user
        message (text), a conversation (a list of {"role", "content"} messages), both
        rendered through the model's chat template, or token ids used as they are.
        temperature 0 is greedy; `seed` makes sampling repeatable; `stop` strings end the
        answer (left out of it). Prompt and answer stay within [training].ctx."""
        from retrograd.sampling.backend import sampler
        from retrograd.sampling.params import SampleRequest, SamplingParams

        ids = self._prompt_ids(prompt)
        params = SamplingParams(temperature, top_p, max_new_tokens, tuple(stop), seed=seed)
        [[answer]] = sampler(self.model, self._base().training, 1).generate(
            [SampleRequest(tuple(ids), params)]
        )
        return answer.text

    def logprobs(self, prompt: str | Sequence, completion: str | Sequence[int]):
        """The log-probability of each token of `completion` after `prompt`, with the trained
        tensors as they are now: a float32 tensor, one value a completion token. `prompt`
        as `generate` takes it; `completion` text (tokenized without BOS) or token ids."""
        import torch

        ids = self._prompt_ids(prompt)
        if isinstance(completion, str):
            completion = self.model.tokenize(completion, add_bos=False, parse_special=False)
        answer = list(completion)
        if not answer:
            raise ConfigError("completion: no tokens")
        with torch.no_grad():
            return self.model.logprobs(list(ids) + answer)[len(ids) - 1 :]

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        prompt = list(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            from retrograd.algorithms.context import chat_format

            return chat_format(self.model).prompt_ids(prompt)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ConfigError("prompt: give text, a list of messages, or a list of token ids")
        return prompt

    def _check_open(self) -> None:
        if self._closed:
            raise TrainingError("this Trainer is closed; make a new one")

    def __repr__(self) -> str:
        path = self._sections["model"].path
        return f"Trainer({str(path)!r}, loaded={self._model is not None})"


@dataclass(frozen=True)
class _Output:
    """What export_output reads of a run: its [output]."""

    output: Any


def _model_table(model: Any, device: str | None) -> Any:
    """[model] from a path, a ModelSection or a dict, with `device` over its device."""
    if isinstance(model, str | Path):
        table: Any = {"path": str(model)}
    elif isinstance(model, dict):
        table = dict(model)
    else:
        table = model
    if device is None:
        return table
    if isinstance(table, dict):
        return {**table, "device": device}
    return check_sections({"model": {**table.model_dump(exclude_unset=True), "device": device}})[
        "model"
    ]


def _output_table(output: Any) -> Any:
    """[output] from a path (the kind derived), an OutputSection or a dict."""
    return {"path": str(output)} if isinstance(output, str | Path) else output
