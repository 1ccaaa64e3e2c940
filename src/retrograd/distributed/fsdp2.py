"""FSDP2 over the decoder: each block's GGUF bytes sharded across the ranks, whole only in its pass.

`shard_decoder` registers the stored bytes of every block's frozen weights (quantized or not,
expert tensors included) as frozen uint8 Parameters on the modules that read them, then calls
`fully_shard` on each block and on the decoder. Between passes a rank holds 1/N of each
block's bytes and of its float norms and biases; FSDP2 gathers a block before its forward and
again before its backward, where the frozen product dequantizes the gathered bytes once more
(`FrozenTensor.raw` reads them through the module at each use).

Replicated on every rank: the token embedding and the output head (read outside the blocks:
embedding lookups, the tiled loss head), the decoder's own norm, and the trained parameters
(LoRA factors, trained base tensors) with their optimizer state. FSDP2 ignores the trained
parameters: their gradients are reduced by the caller as on the ddp path, so adapters, their
export and their checkpoints stay plain tensors.

NOTE: every gather is a collective. Under fsdp2 every rank must run the same sequence of
decoder forwards and backwards (a rank that skips a pass, or decodes a different number of
tokens, leaves the others waiting until [training].dist_timeout_seconds). Only the loops
whose traits say so run here (`distributed.check_traits`, before the model loads).

This module knows the decoder's layout and FSDP2; nothing of losses, data or algorithms.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from retrograd.model.decoder import Decoder
from retrograd.model.layers import Linear
from retrograd.model.moe import Experts

log = logging.getLogger(__name__)

BYTES = "raw"  # the name of a module's Parameter of stored bytes

# NOTE: the identity on purpose. The bytes are uint8, which FSDP2 never casts; norms stay
# float32 by design (the decoder casts to its compute dtype where a product needs it), and the
# trained parameters are not FSDP2's. A param_dtype here would only round the norms.
POLICY = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)


def register_block_bytes(block: nn.Module) -> int:
    """Each frozen weight of the block as a uint8 Parameter `raw` of the module that reads it;
    returns the bytes registered."""
    total = 0
    for module in block.modules():
        if isinstance(module, (Linear, Experts)) and BYTES not in module._parameters:
            module.frozen.register_on(module, BYTES)
            total += module.frozen.raw.numel()
    return total


def shard_decoder(
    decoder: Decoder, trainables: Iterable[nn.Parameter], mesh: DeviceMesh | None = None
) -> DeviceMesh:
    """`fully_shard` every block, then the decoder, over `mesh` (by default one dimension over
    the default process group on the decoder's device type). `trainables`: the parameters the
    run trains; FSDP2 leaves them whole (the caller reduces their gradients)."""
    if mesh is None:
        mesh = init_device_mesh(decoder.device.type, (dist.get_world_size(),))
    cache = decoder.token_embd.cache
    if cache.enabled or cache.int8:  # every weight whole on every rank: what sharding avoids
        log.info("fsdp2: the dequantized-weight cache is off (it would hold whole weights)")
        cache.enabled = cache.int8 = False
        cache.clear()
    kept = set(trainables)
    # NOTE: our blocks return views (a reshaped fused residual); nothing writes into them.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for block in decoder.blk:
        register_block_bytes(block)
        fully_shard(block, mesh=mesh, mp_policy=POLICY, ignored_params=_own(block, kept))
        register_fsdp_forward_method(block, "step")  # Decoder.forward calls block.step
    # The decoder's own parameters (output_norm, the head's bias and adapter) stay whole: the
    # head is used outside forward; the root's fully_shard only drives the blocks' passes.
    fully_shard(decoder, mesh=mesh, mp_policy=POLICY, ignored_params=set(_direct(decoder)))
    decoder.sharded = True
    mib = 1 << 20
    log.info(
        "fsdp2: %d blocks sharded over %d ranks: %.1f MiB of their %.1f MiB on this rank",
        len(decoder.blk),
        mesh.size(),
        local_bytes(decoder) / mib,
        block_bytes(decoder) / mib,
    )
    return mesh


def _own(module: nn.Module, kept: set[nn.Parameter]) -> set[nn.Parameter]:
    return {p for p in module.parameters() if p in kept}


def _direct(decoder: Decoder) -> list[nn.Parameter]:
    """The decoder's parameters outside its blocks."""
    inside = {id(p) for p in decoder.blk.parameters()}
    return [p for p in decoder.parameters() if id(p) not in inside]


def local_bytes(decoder: Decoder) -> int:
    """The bytes of block weights this rank holds now (its shards between passes)."""
    total = 0
    for module in decoder.blk.modules():
        raw = module._parameters.get(BYTES) if isinstance(module, (Linear, Experts)) else None
        if raw is not None:
            local = raw.to_local() if hasattr(raw, "to_local") else raw
            total += local.numel() * local.element_size()
    return total


def block_bytes(decoder: Decoder) -> int:
    """The bytes of all block weights, whole (what one process holds)."""
    modules = decoder.blk.modules()
    return sum(m.frozen.raw.numel() for m in modules if isinstance(m, (Linear, Experts)))
