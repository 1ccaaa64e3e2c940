"""`retrograd train` of base tensors: full, partial and hybrid SFT, the trainable and model
outputs (llama.cpp reads the model with our logits), Muon and Gefen, kill -9 and resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import retrograd
from retrograd.cli.main import main
from retrograd.gguf import GGUFFile
from tests.e2e.test_train_sft import TEXT, kill_after_checkpoint, scalars
from tests.oracles.llama_oracle import llama_logits


def write_run(tmp: Path, model: Path, mode: str, **over) -> Path:
    """An sft run of `mode` on `model` in `tmp`; over: sections (dicts) replacing the defaults."""
    (tmp / "data.txt").write_text(TEXT)
    sections = {
        "run": {"algorithm": "sft"},
        "model": {"path": str(model), "device": "cpu"},
        "output": {"path": "out/result.gguf"},
        "training": {
            "trainable": mode,
            "lr": 1e-3,
            "epochs": 2,
            "ctx": 32,
            "micro_batch": 16,
            "gradient_accumulation": 2,
        },
        "sft": {"data": "data.txt"},
        "metrics": {"tensorboard_dir": "tb"},
    }
    for name, value in over.items():
        if name == "training":
            sections["training"].update(value)
        else:
            sections[name] = value
    lines = []
    for name, table in sections.items():
        if table is None:
            continue
        lines.append(f"[{name.replace('__', '.')}]")
        lines += [f"{k} = {_toml(v)}" for k, v in table.items()]
    path = tmp / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def learned(tmp: Path) -> bool:
    losses = scalars(tmp / "tb", "train/loss")
    first = np.mean([losses[s] for s in sorted(losses)[:4]])
    last = np.mean([losses[s] for s in sorted(losses)[-4:]])
    return last < first


def same_logits_as_llama_cpp(path: Path, base: Path) -> None:
    """llama.cpp loads the written model and computes our logits: exactly on its F32 copy (as
    tests/oracles compare 16-bit files: llama.cpp rounds activations to BF16 for BF16 weights),
    and with the same next token on the file itself."""
    from tests.factories.tiny_gguf import quantize

    ids = [1] + retrograd.load_tokenizer(path).tokenize("the cat sat on the log.", add_bos=False)
    ours = retrograd.load(path, device="cpu", dtype=torch.float32).logits(ids).numpy()
    f32 = quantize(path, path.with_name(path.stem + "-as-f32.gguf"), "ALL_F32")
    ref = llama_logits(f32, ids)
    assert np.abs(ref - llama_logits(base, ids)).max() > 0.05, "training changed nothing"
    assert np.abs(ours - ref).max() < 2e-3
    direct = llama_logits(path, ids)
    assert (direct.argmax(-1) == ours.argmax(-1)).mean() > 0.9


def check_model_copy(base: Path, out: Path, trained: set[str]) -> set[str]:
    """Metadata and tokenizer copied, tensors in order and type, untrained ones byte-identical.
    -> the tensors that changed."""
    a, b = GGUFFile(base), GGUFFile(out)
    assert list(a.tensors) == list(b.tensors)
    for key, value in a.metadata.items():
        if key != "general.name":
            assert np.array_equal(np.asarray(b.metadata[key]), np.asarray(value)), key
    changed = set()
    for name, info in a.tensors.items():
        other = b.tensors[name]
        assert (other.ggml_type, other.shape) == (info.ggml_type, info.shape), name
        if bytes(other.data) != bytes(info.data):
            changed.add(name)
    assert changed and changed <= trained
    return changed


# the tiny architectures whose written model the suite loads in llama.cpp, one of each kind:
# fused projections (phi3), biases (qwen2), post-norms (gemma3), a convolution (lfm2), experts
# (qwen3moe) and a state-space mixer (mamba2), whose untrainable tensors stay as they were.
# docs/trainable.md lists the others checked once (llama, granite, olmo2 and 14 more).
ROUND_TRIP = ["gemma3", "qwen2", "phi3", "lfm2", "qwen3moe", "mamba2"]


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_full_sft_writes_a_model_llama_cpp_reads_like_us(tiny_model, tmp_path, name):
    model = tiny_model(name)
    run = write_run(tmp_path, model, "full", output={"path": "out/m.gguf", "kind": "model"})
    assert main(["train", str(run)]) == 0
    out = tmp_path / "out" / "m.gguf"
    assert learned(tmp_path)
    floats = {n for n in GGUFFile(model).tensors if n != "token_embd.weight"}
    changed = check_model_copy(model, out, floats)
    norms = {n for n in floats if n.endswith("norm.weight")}  # lfm2's last: token_embd_norm
    assert norms and norms <= changed, norms - changed
    same_logits_as_llama_cpp(out, model)


def test_partial_bf16_trains_the_selection_in_its_storage_type(tiny_model, tmp_path):
    """BF16 matrices train through an f32 master copy (master_weights = auto) and are written
    back as BF16; only the selected tensors change; llama.cpp reads the model like us."""
    model = tiny_model("qwen2", "MOSTLY_BF16")
    selection = {
        "layers": "last:1",
        "modules": ["attn_q", "ffn_down"],
        "norms": True,
        "biases": True,
    }
    run = write_run(
        tmp_path, model, "partial", trainable=selection, output={"path": "m.gguf", "kind": "model"}
    )
    assert main(["train", str(run)]) == 0
    out = tmp_path / "m.gguf"
    assert learned(tmp_path)
    trained = {
        "blk.1.attn_q.weight",
        "blk.1.attn_q.bias",
        "blk.1.ffn_down.weight",
        "blk.1.attn_norm.weight",
        "blk.1.ffn_norm.weight",
        "output_norm.weight",
    }
    check_model_copy(model, out, trained)
    assert GGUFFile(out).tensors["blk.1.attn_q.weight"].type_name == "BF16"
    same_logits_as_llama_cpp(out, model)


def test_hybrid_trains_the_adapter_and_the_norms_together(tiny_model, tmp_path):
    model = tiny_model("llama", "MOSTLY_F16")
    run = write_run(
        tmp_path,
        model,
        "hybrid",
        training={"ctx": 128, "micro_batch": 32, "gradient_accumulation": 1},  # the defaults
        lora={"rank": 4, "targets": ["q", "v"], "dtype": "f32"},
        trainable={"norms": True},
    )
    assert main(["train", str(run)]) == 0
    assert learned(tmp_path)
    out = GGUFFile(tmp_path / "out" / "result.gguf")
    base = GGUFFile(model)
    assert out.get("general.type") == "retrograd.trainable"
    norms = {n for n in base.tensors if n.endswith("norm.weight")}
    factors = {f"blk.{i}.attn_{x}.weight.lora_{h}" for i in (0, 1) for x in "qv" for h in "ab"}
    assert set(out.tensors) == norms | factors
    for name in norms:
        assert bytes(out.tensors[name].data) != bytes(base.tensors[name].data), name
    b = out.tensors["blk.0.attn_q.weight.lora_b"].data.view(np.float32)
    assert np.abs(b).max() > 0  # B starts at zero: the adapter trained


def test_trainable_output_holds_the_trained_tensors_in_their_types(tiny_model, tmp_path):
    model = tiny_model("llama", "MOSTLY_F16")
    run = write_run(
        tmp_path,
        model,
        "partial",
        training={"epochs": 1, "master_weights": "off"},
        trainable={"layers": "0..0", "modules": "attn_v"},
    )
    assert main(["train", str(run)]) == 0
    out = GGUFFile(tmp_path / "out" / "result.gguf")
    assert {n: t.type_name for n, t in out.tensors.items()} == {"blk.0.attn_v.weight": "F16"}
    assert out.get("retrograd.trainable.mode") == "partial"


def test_inspect_lists_what_each_mode_trains(gemma_path, capsys):
    assert main(["inspect", "--model", str(gemma_path)]) == 0
    out = capsys.readouterr().out
    full = next(line for line in out.splitlines() if "│ full" in line)
    assert "109 tensors" in full and "0 matrices" in full and "109 norms" in full


def killed_and_whole(tmp_path: Path, model: Path, mode: str, over: dict, out: str):
    """The run uninterrupted, and killed (SIGKILL) after its checkpoint at step 10 then resumed
    with --resume: the same losses step for step. -> the two outputs (whole, resumed)."""
    from retrograd.checkpoint import step_id

    over = {**over, "checkpoint": {"directory": "ck", "mode": "steps", "every_steps": 5}}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    assert main(["train", str(write_run(whole, model, mode, **over))]) == 0
    run = write_run(cut, model, mode, **over)
    kill_after_checkpoint(run, cut / "ck" / f"{step_id(10)}.state")
    assert not (cut / out).exists()
    assert main(["train", str(run), "--resume"]) == 0
    a, b = scalars(whole / "tb", "train/loss"), scalars(cut / "tb", "train/loss")
    assert sorted(a) == sorted(b)
    for step, loss in a.items():
        assert b[step] == pytest.approx(loss, rel=1e-6), step
    return whole / out, cut / out


RESUMED = {
    "muon": {"training": {"optimizer": "muon", "lr": 0.01}, "optimizer__muon": {"ns_steps": 3}},
    "gefen": {
        "training": {"optimizer": "gefen"},
        "optimizer__gefen": {"variant": "quantized_m", "block_size": 256, "min_numel": 1024},
    },
}


@pytest.mark.parametrize("optimizer", sorted(RESUMED))
def test_killed_full_run_resumes_to_the_same_model(tiny_model, tmp_path, optimizer):
    """SIGKILL after a checkpoint, then --resume: losses and the model's bytes equal an
    uninterrupted run's, with Muon's and Gefen's state restored exactly."""
    over = {**RESUMED[optimizer], "output": {"path": "out/m.gguf", "kind": "model"}}
    whole, cut = killed_and_whole(tmp_path, tiny_model("llama"), "full", over, "out/m.gguf")
    assert whole.read_bytes() == cut.read_bytes()


def test_killed_hybrid_run_resumes_to_the_same_adapter_and_norms(tiny_model, tmp_path):
    """hybrid (a rank-4 adapter on q and v, and every norm) with AdamW: killed after a
    checkpoint and resumed, it writes the uninterrupted run's factors and norms, byte for
    byte; both trained."""
    model = tiny_model("llama")
    over = {
        "training": {"optimizer": "adamw"},
        "lora": {"rank": 4, "targets": ["q", "v"], "dtype": "f32"},
        "trainable": {"norms": True},
        "output": {"path": "out/t.gguf"},
    }
    whole, cut = killed_and_whole(tmp_path, model, "hybrid", over, "out/t.gguf")
    assert whole.read_bytes() == cut.read_bytes()
    out, base = GGUFFile(cut), GGUFFile(model)
    norms = {n for n in base.tensors if n.endswith("norm.weight")}
    factors = {f"blk.{i}.attn_{x}.weight.lora_{h}" for i in (0, 1) for x in "qv" for h in "ab"}
    assert set(out.tensors) == norms | factors
    for name in norms:
        assert bytes(out.tensors[name].data) != bytes(base.tensors[name].data), name
    assert np.abs(out.tensors["blk.1.attn_v.weight.lora_b"].data.view(np.float32)).max() > 0


def test_resume_refuses_another_gefen_variant(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    over = {
        "training": {"optimizer": "gefen", "epochs": 1},
        "optimizer__gefen": {"block_size": 256},
        "checkpoint": {"directory": "ck", "mode": "steps", "every_steps": 5},
    }
    run = write_run(tmp_path, model, "full", **over)
    assert main(["train", str(run)]) == 0
    over["optimizer__gefen"] = {"block_size": 256, "variant": "quantized_m"}
    write_run(tmp_path, model, "full", **over)
    capsys.readouterr()
    assert main(["train", str(run), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "gefen.variant: 'shared_v' -> 'quantized_m'" in err


def test_preference_trains_base_tensors(tmp_path):
    """dpo on a partial selection: the reference (the model as the run starts) is scored before
    the first step, so no [reference] is needed; the held-out pairs are learned."""
    from retrograd.algorithms.preference import run_preference
    from retrograd.config import load_run
    from tests.e2e import test_train_preference as pref
    from tests.e2e.test_train_grpo import sinks
    from tests.factories.tiny_gguf import write_tiny

    model = write_tiny(tmp_path / "chat.gguf", "gemma3", chat_template=pref.CHAT_TEMPLATE)
    run = pref.write_run(
        tmp_path,
        model,
        {"loss": "dpo", "pairs_per_step": 4},
        training={"epochs": 3, "trainable": "partial", "lr": 1e-3},
        evaluation='data = "held.jsonl"',
        trainable='layers = "last:2"\nmodules = ["attn_v", "ffn_down"]\nnorms = true',
        lora=None,
    )
    cfg = load_run(run)
    before = pref.held_out_before(cfg)
    result = run_preference(cfg, run_file=run, sinks=sinks())
    after = result.evals[-1][1]
    assert after["eval/preference_loss"] < before["eval/preference_loss"] - 0.05, (before, after)
    out = GGUFFile(tmp_path / "out" / "adapter.gguf")
    assert out.get("retrograd.trainable.mode") == "partial"
    assert "blk.2.ffn_down.weight" in out.tensors and "blk.0.attn_v.weight" not in out.tensors


def test_grpo_trains_base_tensors(tmp_path):
    """GRPO on a partial selection (no KL term, so no [reference]): the reward rises, and the
    written model is the base with the selected tensors changed."""
    from retrograd.algorithms.grpo import run_grpo
    from retrograd.config import load_run
    from tests.e2e import test_train_grpo as grpo
    from tests.factories.tiny_gguf import write_tiny

    model = write_tiny(tmp_path / "chat.gguf", "gemma3", chat_template=grpo.CHAT_TEMPLATE)
    run = grpo.write_run(
        tmp_path,
        model,
        {"updates": 12},
        training={"trainable": "partial", "lr": 3e-3},
        trainable='layers = "last:2"\nmodules = ["attn_v", "ffn_down"]',
        lora=None,
        output={"path": "out/m.gguf", "kind": "model"},
    )
    result = run_grpo(load_run(run), run_file=run, sinks=grpo.sinks())
    first, last = np.mean(result.curve[:3]), np.mean(result.curve[-3:])
    assert last > first + 0.1, result.curve
    trained = {f"blk.{i}.{m}.weight" for i in (1, 2) for m in ("attn_v", "ffn_down")}
    check_model_copy(model, tmp_path / "out" / "m.gguf", trained)
