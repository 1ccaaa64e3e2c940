"""OpenAI-compatible serving of one model: weights selection, the app, the generation worker.

Knows nothing about training: it loads a model (and an adapter), renders prompts with the
model's chat format and generates with the sampler's live batch. Importing this package
imports nothing heavy (the command line reads the defaults below).
"""

# NOTE: answers decoded together. A decode step reads every weight once whatever the batch,
# so rows are cheap until the products turn compute-bound, but each client slows as rows are
# added: Gemma 3 270M on 2 AMX cores made 71 tokens/s for 1 sequence, 360 in all for 8 (45
# each) and 593 for 32 (19 each; docs/performance.md). 16 sits between: most of the batch's
# gain, and each client still faster than anyone reads.
MAX_SEQUENCES = 16
MAX_QUEUE = 64  # requests waiting for a row; past it, 503 with Retry-After
