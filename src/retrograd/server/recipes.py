"""Recipes (formats.md §9.3 PlanRequest.recipe): a client's intent made into a run document.

A recipe names a model, its data and an objective; the server chooses everything else and
says why in the provenance (`derived`, with a reason). Objectives and the algorithm each runs:

| objective | algorithm | data | needs |
| --- | --- | --- | --- |
| instruction-tuning | sft | chat JSONL or text | |
| preference-tuning | preference (dpo) | preference pairs | |
| reasoning-rl | grpo | chat JSONL prompts | reward {id} |
| preference-rl | grpo with the judge's verdicts | chat JSONL prompts | reward {id}, judge {id} |
| agentic | agent_grpo | scenario JSONL | tools [ids of MCP servers, at most one environment] |

Derived values: a LoRA adapter (rank 16, alpha 32, the architecture's `auto` targets, seed
`recipe.seed` or 42), lr 2e-4 (sft) / 1e-5 (rollouts, preference); `training.ctx` the
smallest power of two of at least 128 holding the longest example (chat records through the
model's template; for rollouts the longest prompt plus `max_new_tokens`, 256 or what the
context leaves room for, at least 16), at most the model's
trained context (`allow: ["exceed_train_context"]` lifts that to 4096) and at most 4096;
examples longer than that are refused unless `allow: ["truncate_context"]`. Text data is cut
into ctx windows, so it keeps ctx 128. `micro_batch` min(32, ctx) with
gradient_accumulation 1 (sft, the reference's defaults). `budget.epochs` (sft, preference;
1) or `budget.updates` (rollouts; 100) sets the length; `budget.minutes` (a number > 0, alone
or with the length) ends the run at the first boundary after that many minutes of training
with a checkpoint and its adapter exported, `completed` (child.py); the plan's `total_steps`
is then an upper bound (the length's steps) and `plan.time_budget_minutes` holds the budget.
Agentic recipes take 4 scenarios an update, groups of 8, one epoch, and the largest ctx a
recipe takes (a trajectory's turns fill it).
Rollout recipes export trajectories: `[observe] every = ceil(updates / observe_target_updates)`
into the run's folder (published in GET /v1/defaults). `recipe.limits {vram, ram}` lower the
server's budgets for this run; when the plan is over them the server applies the plan's levers
in order (plans.py) and lists them in `plan.levers_applied`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from retrograd import nesting
from retrograd.server.config import ServerConfig, parse_budget
from retrograd.server.documents import check_file
from retrograd.server.problems import FieldError, Problem, pointer
from retrograd.text import newline_split

OBJECTIVES = {
    "instruction-tuning": "sft",
    "preference-tuning": "preference",
    "reasoning-rl": "grpo",
    "preference-rl": "grpo",
    "agentic": "agent_grpo",
}
RECIPE_FIELDS = (
    "model",
    "data",
    "eval",
    "objective",
    "budget",
    "reward",
    "judge",
    "tools",
    "limits",
    "seed",
    "output",
    "checkpoint_dir",
    "allow",
)
ALLOW = ("truncate_context", "exceed_train_context")
MAX_CTX = 4096
MIN_CTX = 128
MAX_NEW_TOKENS = 256
MIN_NEW_TOKENS = 16  # fewer: the context rules refuse the prompts instead
DEFAULT_UPDATES = 100
# GET /v1/defaults: what a recipe derives
DERIVED_RULES = [
    {
        "path": "run.algorithm",
        "rule": "from recipe.objective: instruction-tuning sft, preference-tuning preference "
        "(dpo), reasoning-rl grpo, preference-rl grpo with the judge, agentic agent_grpo",
        "applies_to": "recipes",
        "client_can_set": False,
        "thresholds": {},
    },
    {
        "path": "training.ctx",
        "rule": "the smallest power of two >= 128 holding the longest example (prompt + "
        f"{MAX_NEW_TOKENS} new tokens for rollouts), at most the model's trained context and "
        f"{MAX_CTX}",
        "applies_to": "recipes",
        "client_can_set": True,
        "thresholds": {"min": MIN_CTX, "max": MAX_CTX},
    },
    {
        "path": "observe.every",
        "rule": "ceil(updates / observe_target_updates): rollout recipes keep the texts of "
        "about observe_target_updates updates",
        "applies_to": "recipes with rollouts (reasoning-rl, preference-rl, agentic)",
        "client_can_set": True,
        "thresholds": {},
    },
    {
        "path": "training",
        "rule": "the plan's levers, in order, while the plan is over the budgets or recipe.limits",
        "applies_to": "recipes",
        "client_can_set": True,
        "thresholds": {},
    },
]


def _bad(at: tuple[str, ...], message: str, code: str = "invalid_value") -> Problem:
    return Problem(
        "invalid-request",
        f"recipe.{'.'.join(at)}: {message}",
        [FieldError(pointer("recipe", *at), code, message)],
    )


class Recipe:
    """A recipe's document, the reason for every value the server chose, and its limits."""

    def __init__(self, recipe: Any, server: ServerConfig, datasets, run_dir: Path):
        if not isinstance(recipe, dict):
            raise _bad((), "must be an object")
        unknown = [k for k in recipe if k not in RECIPE_FIELDS]
        if unknown:
            raise _bad((unknown[0],), f"unknown field (known: {', '.join(RECIPE_FIELDS)})")
        self.recipe, self.server, self.datasets, self.run_dir = recipe, server, datasets, run_dir
        self.document: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}
        self.minutes: float | None = None  # recipe.budget.minutes: the run's time budget
        self.limits = self._limits()
        self.allow = self._allow()
        self._derive()

    # -- reading the recipe ----------------------------------------------------------------

    def _limits(self) -> tuple[int | None, int | None]:
        from retrograd.server.plans import total_ram, total_vram

        limits = self.recipe.get("limits") or {}
        if not isinstance(limits, dict) or set(limits) - {"vram", "ram"}:
            raise _bad(("limits",), 'must be {"vram"?: SIZE, "ram"?: SIZE}')
        out = []
        for name, total in (("vram", total_vram()), ("ram", total_ram())):
            if name not in limits:
                out.append(None)
                continue
            try:
                out.append(parse_budget(limits[name]).bytes_of(total))
            except ValueError as error:
                raise _bad(("limits", name), str(error)) from None
        return out[0], out[1]

    def _allow(self) -> set[str]:
        allow = self.recipe.get("allow") or []
        if not isinstance(allow, list) or any(a not in ALLOW for a in allow):
            raise _bad(("allow",), f"must be a list of {', '.join(ALLOW)}")
        return set(allow)

    def _file(self, at: str) -> Path | None:
        """The file of recipe.<at> ({path} or {dataset}, or a bare path or dataset id)."""
        given = self.recipe.get(at)
        if given is None:
            return None
        if isinstance(given, str):
            given = {"dataset": given} if given.startswith("ds_") else {"path": given}
        if not isinstance(given, dict) or len(set(given) & {"path", "dataset"}) != 1:
            raise _bad((at,), 'must be {"path": FILE} or {"dataset": ID} (and "format"?)')
        if "dataset" in given:
            if self.datasets is None or self.datasets.view(given["dataset"]) is None:
                raise Problem(
                    "not-found",
                    f"recipe.{at}.dataset: no dataset {given['dataset']!r}",
                    [FieldError(pointer("recipe", at, "dataset"), "not_found", "no such dataset")],
                )
            return self.datasets.data_path(given["dataset"])
        return check_file(Path(str(given["path"])), self.server, ("recipe", at, "path"))

    def _format(self) -> str | None:
        given = self.recipe.get("data")
        fmt = given.get("format") if isinstance(given, dict) else None
        if fmt not in (None, "auto", "text", "jsonl", "chat-jsonl", "preference-jsonl"):
            raise _bad(("data", "format"), "must be auto, text, jsonl or preference-jsonl")
        return {"chat-jsonl": "jsonl", "auto": None}.get(fmt, fmt)

    def _set(self, path: str, value: Any, reason: str) -> None:
        table = self.document
        *parents, last = path.split(".")
        for part in parents:
            table = table.setdefault(part, {})
        table[last] = value
        self.reasons[path] = reason

    def apply_lever(self, document: dict[str, Any], lever: dict[str, Any]) -> dict[str, Any]:
        """The document with one of the plan's levers applied ({path, value}); SFT keeps its
        optimizer window when micro_batch shrinks."""
        out = json.loads(json.dumps(document))
        section, key = lever["path"].split(".", 1)
        table = out.setdefault(section, {})
        if key == "micro_batch" and out["run"]["algorithm"] == "sft":
            window = table.get("micro_batch", 32) * table.get("gradient_accumulation", 1)
            table["gradient_accumulation"] = max(1, window // lever["value"])
        table[key] = lever["value"]
        return out

    # -- deriving -----------------------------------------------------------------------------

    def _derive(self) -> None:
        r = self.recipe
        objective = r.get("objective")
        if objective not in OBJECTIVES:
            raise _bad(("objective",), f"must be one of {', '.join(OBJECTIVES)}")
        if not isinstance(r.get("model"), str):
            raise _bad(("model",), "required: the model GGUF", "missing_field")
        if r.get("data") is None:
            raise _bad(("data",), "required: {path} or {dataset}", "missing_field")
        if r.get("tools") and objective != "agentic":
            raise _bad(("tools",), "tools are for the agentic objective")
        model = check_file(Path(r["model"]), self.server, ("recipe", "model"))
        algorithm = OBJECTIVES[objective]
        why = f"objective {objective}"
        self.document["run"] = {"algorithm": algorithm}
        self.reasons["run.algorithm"] = why
        self.document["model"] = {"path": str(model)}
        self._set("lora.rank", 16, "a small adapter for a recipe")
        self._set("lora.alpha", 32.0, "twice the rank")
        self._set("lora.targets", ["auto"], "the architecture's own choice")
        seed = r.get("seed", 42)
        if not isinstance(seed, int) or seed < 0:
            raise _bad(("seed",), "must be a whole number >= 0")
        self._set("lora.seed", seed, "recipe.seed" if "seed" in r else "the default seed")
        budget = self._budget(algorithm)
        data = self._file("data")
        if algorithm == "sft":
            self._sft(data, budget, why)
        elif algorithm == "preference":
            self._preference(data, budget, why)
        elif algorithm == "agent_grpo":
            self._agent(data, budget, why)
        else:
            self._grpo(objective, data, budget, why)
        if isinstance(r.get("output"), str):
            self.document["output"] = {"path": r["output"]}
        if isinstance(r.get("checkpoint_dir"), str):
            self.document["checkpoint"] = {"directory": r["checkpoint_dir"], "mode": "steps"}
            self._set("checkpoint.every_steps", 50, "every served run can be resumed")

    def _budget(self, algorithm: str) -> dict[str, int]:
        budget = self.recipe.get("budget") or {}
        if not isinstance(budget, dict) or len(budget) > 2:
            raise _bad(("budget",), 'must be {"epochs": N}, {"updates": N}, {"minutes": M} or '
                       "minutes with the length")  # fmt: skip
        budget = dict(budget)
        if "minutes" in budget:
            minutes = budget.pop("minutes")
            if isinstance(minutes, bool) or not isinstance(minutes, int | float) or minutes <= 0:
                raise _bad(("budget", "minutes"), "must be a number of minutes > 0")
            self.minutes = float(minutes)
        if len(budget) > 1:
            raise _bad(("budget",), "give one length: epochs or updates")
        unit = "updates" if algorithm in ("grpo", "agent_grpo") else "epochs"
        for name, value in budget.items():
            if name != unit:
                raise _bad(("budget", name), f"{algorithm} runs count {unit}")
            if not isinstance(value, int) or value < 1:
                raise _bad(("budget", name), "must be a whole number >= 1")
        return budget

    def _sft(self, data: Path, budget: dict, why: str) -> None:
        fmt = self._format()
        self.document["sft"] = {"data": str(data)}
        if fmt is not None:
            self.document["sft"]["data_format"] = fmt
        text = fmt == "text" or (fmt is None and _infer(data) == "text")
        lengths = [] if text else self._lengths(data, "chat-jsonl")
        self._context(lengths, 0, why if not text else "text is cut into ctx windows")
        self._training(budget, 2e-4)
        held = self._file("eval")
        if held is not None:
            self._set("evaluation.data", str(held), "recipe.eval")
            self._set("evaluation.every_iterations", 1, "once an epoch")

    def _preference(self, data: Path, budget: dict, why: str) -> None:
        self.document["preference"] = {"data": str(data)}
        self._set("preference.loss", "dpo", why)
        self._context(self._lengths(data, "preference-jsonl"), 0, why)
        self._training(budget, 1e-5)
        held = self._file("eval")
        if held is not None:
            self._set("evaluation.data", str(held), "recipe.eval")
            self._set("evaluation.every_iterations", 1, "once an epoch")

    def _grpo(self, objective: str, data: Path, budget: dict, why: str) -> None:
        r = self.recipe
        if r.get("eval") is not None:
            raise _bad(("eval",), "rollout recipes measure on their own rewards; leave eval out")
        reward = r.get("reward")
        if not isinstance(reward, dict) or set(reward) != {"id"}:
            raise _bad(
                ("reward",), f'{objective} needs {{"id": ...}} of GET /v1/rewards', "missing_field"
            )
        updates = budget.get("updates", DEFAULT_UPDATES)
        grpo: dict[str, Any] = {"prompts": str(data), "reward": reward}
        self.document["grpo"] = grpo
        lengths = self._lengths(data, "prompts")
        room = self._cap()[0] - max(lengths)  # answers as long as the context leaves room for
        new_tokens = MAX_NEW_TOKENS if room < MIN_NEW_TOKENS else min(MAX_NEW_TOKENS, room)
        chosen = {
            "updates": (updates, "recipe.budget.updates" if budget else "the default length"),
            "prompts_per_update": (4, why),
            "group_size": (8, "answers compared per prompt"),
            "grpo_epochs": (1, why),
            "clip_range_low": (0.2, why),
            "clip_range_high": (0.28, why),
            "kl_coefficient": (0.0, "no reference model to hold"),
            "sampling.temperature": (1.0, "the policy ratio assumes unmodified sampling"),
            "sampling.top_p": (1.0, "the policy ratio assumes unmodified sampling"),
            "sampling.max_new_tokens": (new_tokens, f"at most {MAX_NEW_TOKENS}, within ctx"),
            "sampling.seed": (r.get("seed", 42), "recipe.seed" if "seed" in r else "the default seed"),
        }  # fmt: skip
        for key, (value, reason) in chosen.items():
            self._set(f"grpo.{key}", value, reason)
        judge = r.get("judge")
        if objective == "preference-rl" and judge is None:
            raise _bad(
                ("judge",), 'preference-rl needs {"id": ...} of GET /v1/judges', "missing_field"
            )
        if judge is not None:
            if not isinstance(judge, dict) or not isinstance(judge.get("id"), str):
                raise _bad(("judge",), 'must be {"id": ..., "weight"?: W}')
            if set(judge) - {"id", "weight"}:
                raise _bad(("judge",), 'takes "id" and "weight"')
            grpo["judge"] = {"id": judge["id"]}
            weight = judge.get("weight", 1.0)
            self._set(
                "grpo.judge_weight", weight, "recipe.judge.weight" if "weight" in judge else why
            )
        self._context(lengths, new_tokens, why)
        self._training({}, 1e-5)
        self._observe(updates)

    def _observe(self, updates: int) -> None:
        """Rollout recipes export their trajectories, about observe_target_updates of them."""
        target = self.server.observe_target_updates
        self._set(
            "observe.directory",
            str(self.run_dir / "observe"),
            "rollout recipes export trajectories",
        )
        self._set(
            "observe.every",
            max(1, math.ceil(updates / target)),
            f"ceil(updates / observe_target_updates = {target})",
        )

    def _agent(self, data: Path, budget: dict, why: str) -> None:
        """agent_grpo over the scenarios, with the catalogue's MCP servers and environment
        named in recipe.tools; the context as large as a recipe takes (turns fill it)."""
        r = self.recipe
        if r.get("eval") is not None:
            raise _bad(("eval",), "rollout recipes measure on their own rewards; leave eval out")
        tools = r.get("tools") or []
        if not isinstance(tools, list) or not tools:
            raise _bad(("tools",), "agentic needs the ids of GET /v1/mcp-servers or "
                       "/v1/environments", "missing_field")  # fmt: skip
        agent: dict[str, Any] = {"scenarios": str(data)}
        servers, environments = [], []
        for i, tool in enumerate(tools):
            ident = tool.get("id") if isinstance(tool, dict) else tool
            if ident in self.server.catalogue("environment"):
                environments.append({"id": ident})
            elif isinstance(ident, str):  # an MCP server, or an id the catalogue refuses
                servers.append({"id": ident})
            else:
                raise _bad(("tools", str(i)), 'must be an id or {"id": ...}')
        if len(environments) > 1:
            raise _bad(("tools",), "names more than one environment; a run has one")
        if servers:
            agent["mcp_servers"] = servers
        if environments:
            agent["environment"] = environments[0]
        judge = r.get("judge")
        if judge is not None:
            if not isinstance(judge, dict) or set(judge) != {"id"}:
                raise _bad(("judge",), 'must be {"id": ...} of GET /v1/judges')
            agent["judge"] = judge
        self.document["agent"] = agent
        updates = budget.get("updates", DEFAULT_UPDATES)
        seed = r.get("seed", 42)
        chosen = {
            "updates": (updates, "recipe.budget.updates" if budget else "the default length"),
            "scenarios_per_update": (4, why),
            "group_size": (8, "trajectories compared per scenario"),
            "epochs_per_update": (1, why),
            "seed": (seed, "recipe.seed" if "seed" in r else "the default seed"),
        }
        for key, (value, reason) in chosen.items():
            self._set(f"agent.{key}", value, reason)
        cap, _ = self._cap()
        self._set("training.ctx", cap, "the largest a recipe takes: a trajectory's turns fill it")
        self._training({}, 1e-5)
        self._observe(updates)

    def _training(self, budget: dict, lr: float) -> None:
        ctx = self.document["training"]["ctx"]
        self._set("training.lr", lr, "a usual rate for LoRA at this objective")
        if "epochs" in budget or self.document["run"]["algorithm"] in ("sft", "preference"):
            epochs = budget.get("epochs", 1)
            self._set("training.epochs", epochs, "recipe.budget.epochs" if budget else "one pass")
        self._set("training.micro_batch", min(32, ctx), "the reference's default, at most ctx")
        if self.document["run"]["algorithm"] == "sft":
            self._set("training.gradient_accumulation", 1, "the reference's default")

    def _cap(self) -> tuple[int, int]:
        """(the largest ctx a recipe picks, the model's trained context)."""
        from retrograd.server.plans import Shape

        trained = Shape(Path(self.document["model"]["path"])).cfg.n_ctx_train or MAX_CTX
        return (MAX_CTX if "exceed_train_context" in self.allow else min(trained, MAX_CTX)), trained

    def _context(self, lengths: list[int], extra: int, why: str) -> None:
        cap, trained = self._cap()
        longest = max(lengths, default=0) + extra
        ctx = MIN_CTX
        while ctx < longest and ctx < cap:
            ctx *= 2
        ctx = min(ctx, cap) if longest > MIN_CTX else ctx
        reason = f"the longest example takes {longest} tokens" if lengths else why
        if longest > ctx:
            if "truncate_context" not in self.allow:
                raise Problem(
                    "invalid-request",
                    f"the longest example takes {longest} tokens, more than ctx can be "
                    f"({ctx}: the model's trained context {trained}, at most {MAX_CTX}); "
                    'allow "truncate_context" to cut them'
                    + (
                        "" if "exceed_train_context" in self.allow else ' or "exceed_train_context"'
                    ),
                    [FieldError(pointer("recipe", "allow"), "needs_opt_in", "truncate_context")],
                )
            reason = f"{reason}; longer ones are cut (allow truncate_context)"
        self._set("training.ctx", ctx, reason)

    def _lengths(self, data: Path, kind: str) -> list[int]:
        """Token counts of the file's examples with the model's tokenizer and template."""
        from retrograd.server.datasets import _length
        from retrograd.server.plans import chat_format

        chat = chat_format(Path(self.document["model"]["path"]))
        out = []
        for n, line in enumerate(newline_split(data.read_text(encoding="utf-8")), 1):
            if not line.strip():
                continue
            try:
                record = nesting.loads(line)  # nested too deep: TooDeep, a ValueError
                if kind == "prompts":
                    out.append(len(chat.encode(record["messages"], record.get("tools")).ids))
                else:
                    out.append(_length(kind, record, chat.tokenizer, chat))
            except (ValueError, KeyError, TypeError) as error:
                raise _bad(("data",), f"{data.name}:{n}: not a {kind} record ({error})") from None
        if not out:
            raise _bad(("data",), f"{data.name}: no examples")
        return out


def _infer(path: Path) -> str:
    from retrograd.data.sft import infer_format

    return infer_format(path)
