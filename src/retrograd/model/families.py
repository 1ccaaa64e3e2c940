"""The token mixers and feed-forward kinds beside plain attention and the dense FFN, by name.

`ModelConfig.layer_mixer[il]` and `layer_ffn[il]` name an entry here; each family module keeps
its own math and knows nothing of the decoder. A mixer is `fn(block, h, ctx) -> y`: h is the
layer's normed input (B, T, n_embd) in the compute dtype, y its output before the residual.
"""

from __future__ import annotations

from retrograd.model import delta_net, moe, shortconv, ssm

MIXERS: dict = {
    "shortconv": shortconv.mix,
    "delta_net": delta_net.mix,
    "ssm": ssm.mix,
    "attention_ssm": ssm.mix_parallel,
}
FFNS: dict = {"moe": moe.ffn}
