"""Recipes over real requests: an intent made into a run document with the reason for every
derived value, a recipe run trained to the end, the context rules and their opt-ins, rollout
recipes exporting trajectories, and limits met by the plan's levers."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.server.test_server_errors import codes, problem
from tests.e2e.test_train_grpo import REWARD
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_server import RunServer
from tests.factories.tiny_gguf import write_tiny

CHATS = [
    {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]},
    {"messages": [{"role": "user", "content": "a dog"}, {"role": "assistant", "content": "ran"}]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    model = write_tiny(root / "tiny.gguf", "llama", chat_template=CHAT_TEMPLATE)  # trained ctx 256
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    long = {"messages": [{"role": "user", "content": "go on " * 200}, CHATS[0]["messages"][1]]}
    (root / "long.jsonl").write_text(json.dumps(long) + "\n" + json.dumps(CHATS[0]) + "\n")
    prompts = [{"messages": [{"role": "user", "content": "one cat, two"}]}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    scenario = {"id": "s1", "user": "write 1 into answer.txt"}
    (root / "scenarios.jsonl").write_text(json.dumps(scenario) + "\n")
    (root / "reward.py").write_text(REWARD)
    toml = f"""path_roots = ["{root}"]
[[reward]]
id = "plurals"
command = ["python3", "reward.py"]
[[reward]]
id = "letters"
command = [{json.dumps(sys.executable)}, "{root / "reward.py"}"]
[[judge]]
id = "gemma"
type = "ruler"
base_url = "http://127.0.0.1:9/v1"
model = "gemma"
[[environment]]
id = "sandbox"
type = "local"
allow_unsandboxed = true
tools = {{default = "mini", toolset = {{mini = {{tools = ["write_file"]}}}}}}
"""
    server = RunServer(tmp_path_factory.mktemp("srv") / "state", toml=toml)
    yield server.start(), root, model
    server.stop()


def recipe(root, model, **more) -> dict:
    return {"model": str(model), "data": {"path": str(root / "chat.jsonl")}, **more}


def test_an_instruction_tuning_recipe_derives_its_run_and_trains(setup):
    server, root, model = setup
    with server.client() as c:
        asked = recipe(root, model, objective="instruction-tuning", budget={"epochs": 2}, seed=7)
        r = c.post("/plan", json={"recipe": asked, "params": {"training": {"lr": 0.01}}})
        assert r.status_code == 200, r.text
        out = r.json()
        cfg, provenance = out["effective_config"], out["provenance"]
        assert cfg["run"]["algorithm"] == "sft" and cfg["sft"]["data"] == str(root / "chat.jsonl")
        assert cfg["training"]["ctx"] == 128 and cfg["training"]["micro_batch"] == 32
        assert cfg["training"]["epochs"] == 2 and cfg["lora"]["seed"] == 7
        assert provenance["run.algorithm"] == {
            "source": "derived",
            "reason": "objective instruction-tuning",
        }
        assert provenance["training.ctx"]["source"] == "derived"
        assert "longest example" in provenance["training.ctx"]["reason"]
        assert provenance["training.epochs"]["reason"] == "recipe.budget.epochs"
        assert provenance["training.lr"] == {"source": "override"}  # params lock their leaves
        assert out["plan"]["levers_applied"] == [] and out["plan"]["truncation_fraction"] == 0.0

        # a dataset id stands for the file; the run trains to the end
        upload = c.post(
            "/datasets",
            content=(root / "chat.jsonl").read_bytes(),
            headers={"Content-Type": "application/x-ndjson"},
        ).json()
        asked = {**asked, "data": {"dataset": upload["id"]}, "budget": {"epochs": 1}}
        asked["output"] = str(root / "recipe-adapter.gguf")
        run = c.post("/runs", json={"recipe": asked, "name": "recipe"})
        assert run.status_code == 201, run.text
        run = run.json()
        assert run["objective"] == "instruction-tuning" and run["algorithm"] == "sft"
        events = list(server.events(run["id"]))
        assert events[-1][1]["status"] == "completed", server.log()
        steps = [d["global_step"] for k, d in events if k == "progress"]
        assert steps[-1] == run["plan"]["total_steps"]
        assert (root / "recipe-adapter.gguf").read_bytes()[:4] == b"GGUF"
        rules = {d["path"] for d in c.get("/defaults").json()["derived"]}
        assert {"run.algorithm", "training.ctx", "observe.every"} <= rules


def test_a_time_budget_ends_the_run_with_a_checkpoint_and_its_adapter(setup):
    server, root, model = setup
    with server.client() as c:
        # 10000 epochs at most; three seconds of training end it long before
        asked = recipe(root, model, objective="instruction-tuning")
        asked["budget"] = {"minutes": 0.05, "epochs": 10000}
        asked["output"] = str(root / "timed-adapter.gguf")
        run = c.post("/runs", json={"recipe": asked})
        assert run.status_code == 201, run.text
        run = run.json()
        assert run["plan"]["time_budget_minutes"] == 0.05
        events = list(server.events(run["id"]))
        assert events[-1][1]["status"] == "completed", server.log()
        last = [d["global_step"] for k, d in events if k == "progress"][-1]
        assert 0 < last < run["plan"]["total_steps"]
        said = [d["message"] for k, d in events if k == "log"]
        assert any(m.startswith("the time budget (0.05 minutes) ended the run") for m in said)
        checkpoint = [d for k, d in events if k == "checkpoint"][-1]
        assert checkpoint["global_step"] == last
        exported = (root / "timed-adapter.gguf").read_bytes()
        assert exported == open(checkpoint["path"].replace(".state", ".gguf"), "rb").read()
        assert exported[:4] == b"GGUF"


def test_context_rules_and_their_opt_ins(setup):
    server, root, model = setup
    long = {"path": str(root / "long.jsonl")}
    with server.client() as c:
        asked = recipe(root, model, objective="instruction-tuning", data=long)
        r = c.post("/plan", json={"recipe": asked})
        assert codes(problem(r, 422, "invalid-request")) == [("/recipe/allow", "needs_opt_in")]
        cut = c.post("/plan", json={"recipe": {**asked, "allow": ["truncate_context"]}}).json()
        assert cut["effective_config"]["training"]["ctx"] == 256  # the model's trained context
        assert cut["plan"]["truncation_fraction"] == 0.5
        past = {**asked, "allow": ["exceed_train_context"]}
        wide = c.post("/plan", json={"recipe": past}).json()
        assert wide["effective_config"]["training"]["ctx"] == 2048
        assert wide["plan"]["truncation_fraction"] == 0.0
        assert "ctx_exceeds_train_context" in [w["code"] for w in wide["plan"]["warnings"]]


def test_rollout_recipes_reference_the_catalogue_and_export_trajectories(setup):
    server, root, model = setup
    prompts = {"path": str(root / "prompts.jsonl")}
    with server.client() as c:
        asked = recipe(
            root,
            model,
            objective="reasoning-rl",
            data=prompts,
            reward={"id": "plurals"},
            budget={"updates": 250},
        )
        out = c.post("/plan", json={"recipe": asked}).json()
        cfg = out["effective_config"]
        assert cfg["run"]["algorithm"] == "grpo" and cfg["grpo"]["updates"] == 250
        assert cfg["grpo"]["reward_command"] == ["python3", "reward.py"]
        assert cfg["observe"]["every"] == 3  # ceil(250 / observe_target_updates = 100)
        assert out["provenance"]["observe.every"]["source"] == "derived"
        assert out["plan"]["total_steps"] == 250 and out["plan"]["judge_calls_expected"] == 0

        judged = {**asked, "objective": "preference-rl", "judge": {"id": "gemma"}}
        out = c.post("/plan", json={"recipe": judged}).json()
        assert out["effective_config"]["grpo"]["judge"]["type"] == "ruler"
        assert out["plan"]["judge_calls_expected"] == 250 * 4  # one per group

        no_reward = {k: v for k, v in asked.items() if k != "reward"}
        r = c.post("/plan", json={"recipe": no_reward})
        assert codes(problem(r, 422, "invalid-request")) == [("/recipe/reward", "missing_field")]
        r = c.post("/plan", json={"recipe": {**asked, "reward": {"id": "nope"}}})
        problem(r, 422, "unknown-catalog-id")
        timed = c.post("/plan", json={"recipe": {**asked, "budget": {"minutes": 5, "updates": 9}}})
        assert timed.json()["plan"]["time_budget_minutes"] == 5  # 9 updates at most
        assert timed.json()["effective_config"]["grpo"]["updates"] == 9
        r = c.post("/plan", json={"recipe": {**asked, "budget": {"minutes": 0}}})
        assert codes(problem(r, 422, "invalid-request")) == [
            ("/recipe/budget/minutes", "invalid_value")
        ]
        r = c.post("/plan", json={"recipe": {**asked, "budget": {"epochs": 5}}})
        assert codes(problem(r, 422, "invalid-request")) == [
            ("/recipe/budget/epochs", "invalid_value")
        ]

        # agentic: the catalogue's environment and MCP servers named in tools
        agentic = {**asked, "objective": "agentic", "data": {"path": str(root / "scenarios.jsonl")}}
        del agentic["reward"]
        out = c.post("/plan", json={"recipe": {**agentic, "tools": ["sandbox"]}})
        assert out.status_code == 200, out.text
        cfg = out.json()["effective_config"]
        assert cfg["run"]["algorithm"] == "agent_grpo" and cfg["agent"]["updates"] == 250
        assert cfg["agent"]["environment"]["type"] == "local" and cfg["observe"]["every"] == 3
        assert cfg["training"]["ctx"] == 256  # the model's trained context
        r = c.post("/plan", json={"recipe": {**agentic, "tools": ["sandbox", "nope"]}})
        problem(r, 422, "unknown-catalog-id")
        r = c.post("/plan", json={"recipe": agentic})
        assert codes(problem(r, 422, "invalid-request")) == [("/recipe/tools", "missing_field")]
        r = c.post("/plan", json={"recipe": asked, "config": {"run": {"algorithm": "sft"}}})
        assert codes(problem(r, 422, "invalid-request")) == [("/config", "invalid_value")]
        r = c.post("/plan", json={"recipe": {**asked, "epochs": 1}})
        assert codes(problem(r, 422, "invalid-request")) == [("/recipe/epochs", "invalid_value")]


def test_limits_are_met_by_the_plans_levers_or_refused(setup):
    server, root, model = setup
    with server.client() as c:
        asked = recipe(root, model, objective="instruction-tuning")
        free = c.post("/plan", json={"recipe": asked}).json()["plan"]
        need, lever = free["memory"]["ram_bytes"], free["levers"][0]
        limit = need - lever["saves_bytes"] // 2
        fitted = c.post("/plan", json={"recipe": {**asked, "limits": {"ram": limit}}})
        assert fitted.status_code == 200, fitted.text
        plan = fitted.json()["plan"]
        assert plan["levers_applied"] == [{"path": lever["path"], "value": lever["value"]}]
        assert plan["memory"]["ram_bytes"] <= limit
        training = fitted.json()["effective_config"]["training"]
        assert training["micro_batch"] * training["gradient_accumulation"] == 32  # same window
        r = c.post("/plan", json={"recipe": {**asked, "limits": {"ram": "1MiB"}}})
        meta = problem(r, 422, "insufficient-memory")["meta"]
        assert meta["ram_budget_bytes"] == 1 << 20 and meta["unlocks"] == []


def test_a_rollout_recipe_run_exports_its_trajectories(setup):
    server, root, model = setup
    asked = recipe(
        root,
        model,
        objective="reasoning-rl",
        data={"path": str(root / "prompts.jsonl")},
        reward={"id": "letters"},
        budget={"updates": 1},
    )
    small = {"grpo": {"prompts_per_update": 1, "group_size": 2, "sampling": {"max_new_tokens": 4}}}
    with server.client() as c:
        r = c.post("/runs", json={"recipe": asked, "params": small})
        assert r.status_code == 201, r.text
        run = r.json()
        assert run["observed"] is True and run["effective_config"]["observe"]["every"] == 1
        events = list(server.events(run["id"]))
        assert events[-1][1]["status"] == "completed", server.log()
        shown = c.get(f"/runs/{run['id']}/trajectories").json()
        assert shown["observed"] is True and [u["update"] for u in shown["updates"]] == [1]
        assert shown["updates"][0]["rollouts"] == 2 and shown["updates"][0]["texts"] is True
