"""OpenAI-compatible serving of one model: weights selection, the app, the generation worker.

Knows nothing about training: it loads a model (and an adapter), renders prompts with the
model's chat format and generates with the sampler.
"""
