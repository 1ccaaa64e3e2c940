"""A CheckpointState with every field filled, for the checkpoint tests and the kill script."""

from __future__ import annotations

import numpy as np

from retrograd.checkpoint import (
    AdapterState,
    CheckpointState,
    DatasetPosition,
    Identity,
    OptimizerState,
    Progress,
    RngState,
    SchedulerState,
    Slot,
)

SETTINGS = {"lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]}, "sft": {"lr": 1e-4}}


def make_state(
    step: int = 100,
    *,
    seed: int = 0,
    adapter_dtype: str = "f16",
    trainable: bool = True,
    optimizer_bytes: int = 64,
) -> CheckpointState:
    rng = np.random.default_rng(seed)
    pairs = {
        f"blk.{i}.attn_q.weight": (
            rng.standard_normal((4, 32)).astype(np.float32),
            rng.standard_normal((48, 4)).astype(np.float32),
        )
        for i in (0, 1, 10)
    }
    slots = (
        Slot("adamw", "blk.0.attn_q.weight.lora_a", "exp_avg", "f32", (4, 32), rng.bytes(512)),
        Slot("adamw", "blk.0.attn_q.weight.lora_a", "step", "f32", (), rng.bytes(4)),
        Slot("adamw", "blk.0.attn_q.weight.lora_b", "exp_avg_sq", "bf16", (48, 4), rng.bytes(384)),
        Slot("adamw", "big", "exp_avg", "u8", (optimizer_bytes,), rng.bytes(optimizer_bytes)),
    )
    groups = ({"lr": 1e-4, "betas": [0.9, 0.999], "params": ["blk.0.attn_q.weight.lora_a"]},)
    return CheckpointState(
        architecture="llama",
        progress=Progress(
            step,
            epoch=2,
            update=0,
            best_metric=1.25,
            stale_evaluations=1,
            extra={"tokens_seen": 12345, "note": "x"},
        ),
        identity=Identity(
            model_signature="sha256:" + "1" * 64,
            model_bytes=123456,
            model_fingerprint="sha256:" + "ab12" * 16,
            data_fingerprint="sha256:" + "cd34" * 16,
            algorithm="sft",
            trajectory_settings=SETTINGS,
            app_version="0.1.0",
        ),
        scheduler=SchedulerState("cosine", step, 1000, 1e-4, 10, 9.5e-5),
        optimizer=OptimizerState("adamw", {"lr": 1e-4, "max_grad_norm": 1.0}, groups, slots),
        rng=RngState(
            {"torch": rng.bytes(100), "python": b"\x00\x01"}, {"lora": 42, "shuffle": 2**63 + 5}
        ),
        dataset=DatasetPosition(
            epoch=2, index=17, extra={"permutation_seed": 7, "order": [3, 1, 2]}
        ),
        adapter=AdapterState(rank=4, alpha=8.0, dtype=adapter_dtype, tensors=pairs),
        trainable={
            "blk.0.attn_norm.weight": rng.standard_normal(32).astype(np.float32),
            "output.weight": rng.standard_normal((16, 32)).astype(np.float16),
        }
        if trainable
        else None,
        trainable_plan={"mode": "hybrid", "trained": ["blk.0.attn_norm.weight"]},
        artifacts={"critic.bin": rng.bytes(33)},
    )
