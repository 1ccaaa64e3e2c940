"""What is trained: LoRA adapters on frozen GGUF weights, and base tensors in their own types
(full, partial, hybrid: plan.py chooses, base.py trains them); PPO's value head."""
