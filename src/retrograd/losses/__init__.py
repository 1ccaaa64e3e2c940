"""Loss functions: pure functions of tensors (and of the head they read), no training state."""
