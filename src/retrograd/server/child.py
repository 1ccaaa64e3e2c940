"""A served run's process: the loop `retrograd train` runs, reporting to the server.

    python -m retrograd.server.child RUN_DIR [--resume]

reads RUN_DIR/run.json (the document and its base folder), validates it as a run file, and runs
the algorithm's loop with `ServerSinks` (its reports) and `ServerControl` (the commands). What the loop reports goes to the server as JSON lines
on the process's original stdout (fd 1 is pointed at stderr, so that nothing else can write
there); the server's commands arrive as JSON lines on stdin and are acted on at the loop's next
boundary (algorithms/frame.py's Control, after an update's or a step's report): pause, resume, cancel (with
or without a checkpoint first), checkpoint, stop (checkpoint, then end as interrupted), patch
(keys followed from then on), generate, chat and evaluate (answers from the weights as they are,
sent back under the request's id; a paused run answers too). When stdin closes the server is
gone and the process ends at once. The server never reads this module's memory.

A run with a time budget (run.json's plan.time_budget_minutes, a recipe's budget.minutes) ends
at the first boundary after that many minutes of training (counted from the loop's start in
this process): a checkpoint, the adapter exported from it to [output].path, and `completed`,
with a log event saying that the time budget ended it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from retrograd.observe.sinks import Sinks, StartInfo
from retrograd.server.documents import merge

BUDGET = "budget"  # Stop's outcome when the time budget ends the run (it completes)


class Stop(BaseException):  # noqa: N818 - BaseException: the loops' `except Exception` must not take it
    """Raised inside the loop at a boundary to end the run (cancel, or stop for a restart)."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


class Channel:
    """The JSON lines to the server, and the commands from it (read on a thread)."""

    def __init__(self, out, commands):
        self.out = out
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.pending: list[dict[str, Any]] = []
        threading.Thread(target=self._read, args=(commands,), daemon=True).start()

    def send(self, kind: str, **body: Any) -> None:
        with self.lock:
            self.out.write(json.dumps({"type": kind, **body}, default=str) + "\n")
            self.out.flush()

    def _read(self, commands) -> None:
        for line in commands:
            try:
                command = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                self.pending.append(command)
                self.cond.notify_all()
        os._exit(3)  # the server is gone: nobody is left to report to

    def take(self) -> list[dict[str, Any]]:
        with self.cond:
            taken, self.pending = self.pending, []
            return taken

    def wait(self) -> list[dict[str, Any]]:
        with self.cond:
            while not self.pending:
                self.cond.wait()
            taken, self.pending = self.pending, []
            return taken


class ServerSinks(Sinks):
    """The run's sinks (TensorBoard, W&B, the log) that also report to the server's channel."""

    def __init__(self, channel: Channel, console):
        super().__init__(console=console)
        self.channel = channel
        self.iterations = 0
        self.position = {"iteration": 0, "global_step": 0}  # the last step reported

    def start(self, start: StartInfo) -> None:
        super().start(start)
        self.iterations = start.iterations
        self.position = {"iteration": 0, "global_step": start.initial_step}
        self.channel.send("started", iterations=start.iterations, total_steps=start.total_steps)

    def resumed(self, source: str, global_step: int) -> None:
        super().resumed(source, global_step)
        self.channel.send("log", message=f"resumed from {Path(source).name} at step {global_step}")

    def step(self, global_step, epoch, values, tokens, seconds, position=None) -> None:
        super().step(global_step, epoch, values, tokens, seconds, position)
        values = {k: float(v) for k, v in values.items()}
        iteration = position if position is not None else epoch + 1
        progress = {
            "iteration": iteration,
            "iterations": self.iterations,
            "global_step": global_step,
            "train_loss": values.get("train/loss"),
            "reward": values.get("reward/mean"),
            "learning_rate": values.get("optimizer/learning_rate"),
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
        }
        progress = {k: v for k, v in progress.items() if v is not None}
        self.position = {"iteration": iteration, "global_step": global_step}
        self.channel.send("progress", **progress)
        self.channel.send("metrics", iteration=iteration, global_step=global_step, values=values)

    def checkpoint(self, path: Path, global_step: int) -> None:
        super().checkpoint(path, global_step)
        self.channel.send("checkpoint", path=str(path), global_step=global_step)

    def evaluation(self, global_step: int, values: dict[str, float], improved: bool) -> None:
        super().evaluation(global_step, values, improved)
        values = {k: float(v) for k, v in values.items()}
        self.channel.send("evaluation", global_step=global_step, values=values, improved=improved)

    def note(self, message: str) -> None:
        super().note(message)
        self.channel.send("log", message=message)

    def warn(self, message: str) -> None:
        super().warn(message)
        self.channel.send("log", message=f"warning: {message}")


class ServerControl:
    """The server's commands to the run (algorithms/frame.py's Control), acted on at the
    loop's boundary; answers go back on the channel, with the position `sinks` last reported."""

    def __init__(self, channel: Channel, sinks: ServerSinks):
        self.channel, self.sinks = channel, sinks
        self.want_checkpoint = False
        self.stop_after_checkpoint: str | None = None
        self.pause_after_checkpoint = False
        self.patched: dict[str, dict[str, Any]] = {}  # {section: {key: value}} a client changed
        self.measure = lambda: None  # the loop's own evaluation, without patience
        self.minutes: float | None = None  # the time budget (run.json's plan)
        self.deadline: float | None = None  # time.monotonic() when the budget runs out
        self.last_checkpoint: Path | None = None
        self.live: LiveModel | None = None

    @property
    def position(self) -> dict[str, int]:
        return self.sinks.position

    def opened(self, run) -> None:
        """The run's model is loaded: answers come from it; the time budget starts now."""
        self.live = LiveModel(run.cfg, run.model, run.tr.plan)
        if self.minutes is not None:
            self.deadline = time.monotonic() + self.minutes * 60

    def boundary(self, cfg, measure):
        """What was asked since the last boundary, done; the config with a client's changes."""
        self.measure = measure
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.deadline = None  # once: a checkpoint now, then the run ends (checkpoint_written)
            self.want_checkpoint = True
            self.stop_after_checkpoint = BUDGET
            self.sinks.note(
                f"the time budget ({self.minutes:g} minutes) ended the run at step "
                f"{self.position['global_step']}: a checkpoint, then the adapter exported"
            )
        self._obey(self.channel.take())
        return self.follow(cfg)

    def follow(self, cfg):
        """`cfg` with the [training] and [evaluation] keys a client changed ([checkpoint]'s
        are checkpoint_section's)."""
        changed = {
            name: getattr(cfg, name).model_copy(update=keys)
            for name, keys in self.patched.items()
            if name in ("training", "evaluation") and getattr(cfg, name) is not None
        }
        return cfg.model_copy(update=changed) if changed else cfg

    def _obey(self, commands: list[dict[str, Any]]) -> None:
        for command in commands:
            op = command.get("op")
            if op == "checkpoint":
                self.want_checkpoint = True
            elif op in ("cancel", "stop"):
                outcome = "cancelled" if op == "cancel" else "interrupted"
                if op == "stop" or command.get("checkpoint"):
                    self.want_checkpoint = True
                    self.stop_after_checkpoint = outcome
                else:
                    raise Stop(outcome)
            elif op == "pause":
                self._pause()
            elif op in ("generate", "chat", "evaluate", "patch"):
                self._answer(command)

    def _answer(self, command: dict[str, Any]) -> None:
        """A request answered at this boundary, sent back by its id: `generate` and `evaluate`
        (the weights as they are), `chat` (an OpenAI chat request: its answer or its OpenAI
        error document), `patch` (the [checkpoint] keys followed from now on)."""
        rid = command["request_id"]
        try:
            if command["op"] == "chat":
                status, body = self.live.complete(command["request"])
                self.channel.send("answer", request_id=rid, body=body, status=status)
            else:
                owner = self if command["op"] in ("patch", "evaluate") else self.live
                asked = getattr(owner, command["op"])(command["request"])
                self.channel.send("answer", request_id=rid, body={**self.position, **asked})
        except Exception as error:  # the request's failure, not the run's
            self.channel.send("answer", request_id=rid, error=f"{type(error).__name__}: {error}")

    def _pause(self) -> None:
        """Wait at this boundary (the device stays held) until resume, cancel or stop; a
        checkpoint asked for meanwhile is written now and the wait goes on after it."""
        self.channel.send("paused")
        while True:
            later = self.channel.wait()
            asked = ("generate", "chat", "evaluate", "patch")
            for command in [c for c in later if c.get("op") in asked]:
                self._answer(command)  # a paused run still answers with its weights
            ops = {c.get("op") for c in later}
            if ops & {"resume", "cancel", "stop"}:
                self.channel.send("resumed")
                self._obey([c for c in later if c.get("op") not in ("resume", "pause")])
                return
            if "checkpoint" in ops:
                self.want_checkpoint = True
                self.pause_after_checkpoint = True
                return

    def checkpoint_requested(self) -> bool:
        return self.want_checkpoint

    def checkpoint_section(self, cfg):
        ck, keys = cfg.checkpoint, self.patched.get("checkpoint")
        return ck.model_copy(update=keys) if ck is not None and keys else ck

    def patch(self, request: dict[str, Any]) -> dict[str, Any]:
        """New keys ({section: {key: value}}, checked by the server), followed from this
        boundary on: the next step's rate, the next evaluation's schedule and patience, the
        next checkpoint."""
        for section, keys in request.items():
            self.patched.setdefault(section, {}).update(keys)
        return {"applied": [f"{s}.{k}" for s, keys in request.items() for k in keys]}

    def evaluate(self, _request: dict[str, Any]) -> dict[str, Any]:
        """The loop's own evaluation with the weights as they are; its best checkpoint and its
        patience do not see it."""
        measured = self.measure()
        if measured is None:
            raise ValueError("the run has no evaluation data ([evaluation].data)")
        return measured

    def checkpoint_written(self, path: Path, global_step: int) -> None:
        """The sinks have sent it; a stop or a pause asked for with it happens now."""
        self.want_checkpoint = False
        self.last_checkpoint = Path(path)
        if self.stop_after_checkpoint is not None:
            raise Stop(self.stop_after_checkpoint)
        if self.pause_after_checkpoint:
            self.pause_after_checkpoint = False
            self._pause()


class LiveModel:
    """Generation with the training model itself, between two steps: the adapter's current
    weights, and the base model with the adapter switched off (adapter runs only). Sampling
    seeds its own generators, so the run's random state is left as it was."""

    def __init__(self, cfg, model, plan):
        self.cfg, self.model, self.plan = cfg, model, plan
        self.sampler = None
        self.ctx = 0  # the answers' context, with `chat` (the format) set by _ready

    def _ready(self) -> None:
        from retrograd.algorithms.context import chat_format
        from retrograd.sampling import Sampler
        from retrograd.sampling.engine import run_settings

        if self.sampler is None:
            model = self.model
            self.ctx = min(4096, model.config.n_ctx_train or 4096)
            settings = run_settings(self.cfg.training)  # fast_sampling_context, kv_dtype
            self.sampler = Sampler(model.decoder, model.tokenizer, max_len=self.ctx, **settings)
            variables = getattr(self.cfg.algorithm_section, "template_variables", None)
            self.chat = chat_format(model, variables)

    def complete(self, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of an OpenAI chat request, answered as `retrograd serve` does."""
        from retrograd.openai_app import protocol as proto
        from retrograd.openai_app.app import sample_request

        self._ready()
        try:
            req = proto.parse_request(data)
            proto.check_supported(req)
            tools = proto.tools_for_prompt(req)
            sample = sample_request(self, req, tools)
        except proto.ApiError as error:
            return error.status, error.body()
        [[answer]] = self.sampler.generate([sample])
        parsed = self.chat.parse(answer.text) if tools else None
        message, finish = proto.message_of(answer.text, parsed)
        usage = proto.usage_of(answer)
        return 200, proto.completion_body(req.model, message, finish or answer.finish_reason, usage)

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from retrograd.openai_app.weights import set_adapter
        from retrograd.sampling import SampleRequest, SamplingParams

        self._ready()
        model = self.model
        text = request["prompt"]
        if request.get("chat", True):
            ids = self.chat.prompt_ids([{"role": "user", "content": text}])
        else:
            ids = model.tokenizer.tokenize(text, add_bos=True)
        params = SamplingParams(
            temperature=request.get("temperature", 0.7),
            top_p=request.get("top_p", 0.95),
            max_new_tokens=request.get("max_new_tokens", 128),
            seed=request.get("seed", 0),
        )
        sample = SampleRequest(tuple(ids), params)
        [[answer]] = self.sampler.generate([sample])
        out = {"text": answer.text, "prompt_tokens": len(ids), "tokens": len(answer.ids)}
        if request.get("include_base") and self.plan.rank:
            set_adapter(model.decoder, False)
            try:
                [[base]] = self.sampler.generate([sample])
            finally:
                set_adapter(model.decoder, True)
            out["base_text"] = base.text
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retrograd.server.child")
    parser.add_argument("run_dir")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints go to the run's log, never into the channel
    channel = Channel(out, sys.stdin)

    from rich.console import Console

    from retrograd.algorithms import table
    from retrograd.algorithms.door import Door
    from retrograd.config import validate_run
    from retrograd.errors import RetrogradError

    run_dir = Path(args.run_dir)
    record = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    sinks = ServerSinks(channel, Console(file=sys.stderr, width=120))
    control = ServerControl(channel, sinks)
    control.patched = record.get("patched") or {}
    control.minutes = (record.get("plan") or {}).get("time_budget_minutes")
    try:
        document = record["document"]
        cfg = validate_run(document, source="the run document", base_dir=record["base_dir"])
        resume = True if args.resume and _has_checkpoint(cfg) else None
        lr = control.patched.get("training", {}).get("lr")
        if lr is not None:  # the rate it starts with: the patched one, or its checkpoint's
            started = {"training": {"lr": _checkpoint_lr(cfg, lr) if resume else lr}}
            cfg = validate_run(
                merge(document, started), source="the run document", base_dir=record["base_dir"]
            )
        table.run(cfg, Door(sinks, control, resume=resume, run_file=run_dir / "run.json"))
    except Stop as stop:
        if stop.outcome != BUDGET:
            channel.send(stop.outcome)
            return 0
        try:
            exported = _export_budget(cfg, control.last_checkpoint)
        except Exception as error:  # the checkpoint is there: the error says where
            sinks.fail(str(error))
            channel.send("failed", error=str(error))
            return 1
        sinks.finish({"adapter": str(exported), "stopped early": "yes (time budget)"})
    except RetrogradError as error:
        sinks.fail(str(error))
        channel.send("failed", error=str(error))
        return 1
    except Exception as error:  # anything else: the run failed; the log keeps the traceback
        traceback.print_exc()
        sinks.fail(f"{type(error).__name__}: {error}")
        channel.send("failed", error=f"{type(error).__name__}: {error}")
        return 1
    channel.send("completed")
    return 0


def _checkpoint_lr(cfg, patched: float) -> float:
    """The [training].lr the latest checkpoint was written with (checkpoint/run.py records the
    rate followed then): a checkpoint from before a PATCH resumes at its own rate, the patched
    one following from the first boundary (its identity would refuse another)."""
    from retrograd.checkpoint import latest_checkpoint
    from retrograd.checkpoint.layout import read_manifest

    settings = read_manifest(latest_checkpoint(cfg.checkpoint.directory))["trajectory_settings"]
    return settings.get("lr", patched)


def _export_budget(cfg, checkpoint: Path | None) -> Path:
    """[output].path from the checkpoint the time budget's end wrote: the adapter it exports
    beside its state, copied atomically (what a recipe's runs make: adapters)."""
    from retrograd.gguf import atomic_copy

    kind = cfg.output.kind or "adapter"
    source = checkpoint.with_suffix(".gguf") if checkpoint is not None else None
    if kind != "adapter" or source is None or not source.is_file():
        raise RuntimeError(
            f"the time budget ended the run, but its {kind} could not be exported to "
            f"{cfg.output.path}: a time budget exports adapters; resume from the checkpoint "
            f"{checkpoint} to finish it"
        )
    out = Path(cfg.output.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_copy(source, out)


def _has_checkpoint(cfg) -> bool:
    from retrograd.checkpoint import latest_checkpoint

    return cfg.checkpoint is not None and latest_checkpoint(cfg.checkpoint.directory) is not None


if __name__ == "__main__":
    sys.exit(main())
