"""User-facing errors.

Every error a user can cause is a RetrogradError subclass whose message names the place:
a config key (`[grpo].group_size = 1: must be 2 to 256`), a file and line
(`data.jsonl:17: missing "messages"`), or a GGUF file and tensor. `assert` is kept for our
own invariants; nothing here knows about torch.
"""


class RetrogradError(Exception):
    """Base of every error caused by input; the CLI prints it without a traceback."""


class ConfigError(RetrogradError):
    """A run file or a command-line flag is invalid."""


class GGUFError(RetrogradError):
    """A GGUF file cannot be read, or holds something we do not support."""


class UnsupportedError(GGUFError):
    """A GGUF uses an architecture, tensor type or tokenizer we do not support."""


class TokenizerError(RetrogradError):
    """A vocabulary or chat template cannot be built or rendered."""


class DataError(RetrogradError):
    """A dataset record is malformed; the message names file and line."""


class DeviceError(RetrogradError):
    """The requested device is not available."""


class CheckpointError(RetrogradError):
    """A checkpoint is missing, incomplete, corrupt, or of another format version."""


class TrainingError(RetrogradError):
    """Training cannot go on (a non-finite loss or gradient); the message names the step."""


class RewardError(RetrogradError):
    """A reward program failed a batch; the message names the key, the batch, the line and
    quotes the program's stderr."""


class JudgeError(RewardError):
    """A command judge failed a group (GRPO's judge_failure decides what happens next)."""


class EnvironmentFailure(RetrogradError):
    """An agent environment failed a trajectory (set-up, a broken tool, a lost server): the
    trajectory is dropped, not shown an observation. The message names the scenario."""


class RolloutBackendError(RetrogradError):
    """The rollout backend a run chose cannot serve it: llama.cpp missing, a model or adapter
    it refuses, a decode that fails. The message names the key and what to change."""
