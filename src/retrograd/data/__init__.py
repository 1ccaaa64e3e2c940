"""Datasets: files turned into token ids and train masks. Knows tokenizers, not models."""
