"""What is trained: LoRA adapters on frozen GGUF weights (and, with later modes, base tensors)."""
