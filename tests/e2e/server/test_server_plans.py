"""Plans, memory budgets, calibration, preflight and fork_from, each over real requests to a
real server: the plan's step count against what the run then does, a budget too small refused
with the lever that would make it fit, a forked run starting from another run's adapter."""

from __future__ import annotations

import tomllib

import pytest

from tests.e2e.server.test_server_errors import codes, problem
from tests.factories.agents import CHAT_TEMPLATE
from tests.factories.run_server import RunServer, sft_toml
from tests.factories.tiny_gguf import write_tiny

TOML = {"Content-Type": "application/toml"}
SHORT = "the cat sat on the mat. the dog sat on the log. " * 2  # a few steps


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    model = write_tiny(root / "tiny.gguf", "llama", chat_template=CHAT_TEMPLATE)
    toml = sft_toml(model, root / "data.txt", text=SHORT)
    server = RunServer(tmp_path_factory.mktemp("srv") / "state", toml=f'path_roots = ["{root}"]')
    yield server.start(), root, model, toml
    server.stop()


def finish(server, run_id: str) -> list[tuple[str, dict]]:
    events = list(server.events(run_id))
    assert events[-1] == ("terminal", events[-1][1]) and events[-1][1]["status"] == "completed", (
        events[-1],
        server.log(),
    )
    return events


def test_plan_counts_the_steps_the_run_takes_and_estimates_its_memory(setup):
    server, root, model, toml = setup
    with server.client() as c:
        r = c.post("/plan", content=toml, headers=TOML)
        assert r.status_code == 200, r.text
        plan = r.json()["plan"]
        assert plan["schema_version"] == 1 and plan["iterations"] == 1
        assert plan["truncation_fraction"] == 0.0 and plan["judge_calls_expected"] == 0
        posts = {p["post"]: p["bytes"] for p in plan["memory"]["posts"]}
        assert posts["base_weights"] == model.stat().st_size - _header(model)
        assert posts["adapters_and_optimizer"] > 0 and posts["activations"] > 0
        assert plan["memory"]["device"] == "cpu"
        assert plan["memory"]["ram_bytes"] == sum(posts.values())
        assert "training.optimizer" in plan["defaults_applied"]
        provenance = r.json()["provenance"]
        assert provenance["training.optimizer"] == {"source": "default"}
        assert provenance["training.lr"]["source"] == "override"

        # the reference defaults (ctx 128, micro_batch 32) planned too
        document = tomllib.loads(toml)
        for key in ("ctx", "micro_batch", "gradient_accumulation"):
            del document["training"][key]
        wide = c.post("/plan", json={"config": document}).json()["plan"]
        assert wide["execution"]["ctx"] == 128 and wide["execution"]["micro_batch"] == 32
        assert wide["total_steps"] > 0 and wide["memory"]["ram_bytes"] > plan["memory"]["ram_bytes"]

        run = c.post("/runs", content=toml, headers=TOML).json()
        assert run["plan"]["total_steps"] == plan["total_steps"]
        events = finish(server, run["id"])
        steps = [d["global_step"] for k, d in events if k == "progress"]
        assert steps[-1] == plan["total_steps"]


def _header(model) -> int:
    """Bytes of the GGUF that are not tensor data (header, metadata, alignment)."""
    from retrograd.gguf import GGUFFile

    return model.stat().st_size - GGUFFile(model).n_bytes


def test_calibrated_plan_measures_one_step_in_its_own_process(setup):
    server, _, _, toml = setup
    with server.client() as c:
        r = c.post("/plan", params={"calibrate": "true"}, content=toml, headers=TOML)
        assert r.status_code == 200, r.text
        measured = r.json()["plan"]["memory"]["measured"]
        assert measured["measured"] is True and measured["device"] == "cpu"
        assert measured["tokens"] == 16
        assert measured["ram_peak_bytes"] >= measured["ram_after_load_bytes"] > 0


def test_a_plan_over_the_budget_is_refused_with_the_lever_that_fits(setup, tmp_path):
    server, root, _, toml = setup
    with server.client() as c:
        plan = c.post("/plan", content=toml, headers=TOML).json()["plan"]
    need = plan["memory"]["ram_bytes"]
    lever = plan["levers"][0]
    budget = int((need - lever["saves_bytes"] // 2) / 0.9)  # margin 0.1: the lever fits
    small = RunServer(
        tmp_path / "state",
        toml=f'path_roots = ["{root}"]\nram_budget = {budget}\ncalibrate_runs = false',
    )
    with small, small.client() as c:
        doc = problem(c.post("/runs", content=toml, headers=TOML), 422, "insufficient-memory")
        meta = doc["meta"]
        assert meta["overflow_bytes"] == need - int(budget * 0.9)
        assert meta["ram_budget_bytes"] == int(budget * 0.9) and meta["vram_budget_bytes"] is None
        assert meta["dominant_posts"][0] == {"post": "base_weights", "bytes": max(
            p["bytes"] for p in plan["memory"]["posts"]
        )}  # fmt: skip
        assert meta["unlocks"] == [{"path": lever["path"], "value": lever["value"]}]
        assert meta["levers_applied"] == []
        assert c.get("/runs").json()["runs"] == []  # nothing was created
        params = {"training": {"micro_batch": lever["value"], "gradient_accumulation": 4}}
        fits = c.post("/plan", json={"config": tomllib.loads(toml), "params": params})
        assert fits.status_code == 200, fits.text
        r = c.post("/plan", params={"calibrate": "true"}, content=toml, headers=TOML)
        assert problem(r, 409, "conflict")["errors"][0]["code"] == "conflict"


def test_preflight_reports_where_every_operation_ran(setup, tmp_path):
    server, _, model, _ = setup
    with server.client() as c:
        r = c.post("/preflight", json={"model": str(model), "targets": "q,v", "device": "cpu"})
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["ok"] is True and report["device"] == "cpu"
        assert report["fallbacks"] == {} and report["failures"] == {}
        assert report["operations"] > 0 and report["loss"] > 0
        assert {t.rsplit(".", 1)[1] for t in report["targets"]} == {"attn_q", "attn_v"}
        outside = write_tiny(tmp_path / "outside.gguf", "llama")
        r = c.post("/preflight", json={"model": str(outside)})
        assert codes(problem(r, 403, "forbidden-path")) == [("/model", "forbidden_path")]
        r = c.post("/preflight", json={"model": str(model), "targets": ["nope"]})
        assert "nope" in problem(r, 422, "invalid-request")["detail"]


def test_fork_from_starts_a_run_from_another_runs_adapter(setup, tmp_path):
    server, root, _, toml = setup
    with server.client() as c:
        first = c.post("/runs", content=toml, headers=TOML).json()
        finish(server, first["id"])
        adapter = first["effective_config"]["output"]["path"]

        r = c.post("/runs", json={"fork_from": {"run": first["id"]}, "name": "fork"})
        assert r.status_code == 201, r.text
        fork = r.json()
        lora = fork["effective_config"]["lora"]
        assert lora["init_adapter"] == adapter and "rank" not in fork["provenance"]
        assert fork["provenance"]["lora.init_adapter"] == {
            "source": "derived",
            "reason": f"fork_from run {first['id']}",
        }
        assert fork["effective_config"]["output"]["path"] != adapter  # its own folder
        finish(server, fork["id"])
        mine = c.get(f"/runs/{fork['id']}/artifacts/adapter").content
        assert (
            mine[:4] == b"GGUF" and mine != c.get(f"/runs/{first['id']}/artifacts/adapter").content
        )

        # a document of its own starting from an adapter file, checked like every path
        document = tomllib.loads(toml)
        r = c.post("/plan", json={"config": document, "fork_from": {"path": adapter}})
        assert problem(r, 403, "forbidden-path")["errors"][0]["pointer"] == "/fork_from/path"
        copy = root / "start.gguf"
        copy.write_bytes(c.get(f"/runs/{first['id']}/artifacts/adapter").content)
        r = c.post("/plan", json={"config": document, "fork_from": {"path": str(copy)}})
        assert r.status_code == 200 and r.json()["effective_config"]["lora"]["init_adapter"] == str(
            copy
        )

        problem(c.post("/runs", json={"fork_from": {"run": "run_0000"}}), 404, "not-found")
        r = c.post("/runs", json={"fork_from": {"run": first["id"], "checkpoint": "step-999"}})
        problem(r, 404, "not-found")
        r = c.post("/runs", json={"fork_from": {"path": str(copy)}})
        assert codes(problem(r, 422, "invalid-request")) == [("/config", "missing_field")]
