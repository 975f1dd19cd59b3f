"""flash-attn-4's Hopper backward at head dims that are not multiples of 32 (72: SigLIP's and Qwen3-VL's
ViTs, 80: Qwen2.5-VL's), where installed.

Its kernel class (flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90) rounds the head dim of its
tiles up to a multiple of 16, while its interface allocates, zeroes and reads back the dQ accumulator
rounded up to 32: the kernel never writes the columns between (80-95 at head dims 72 and 80), and they
come back into dQ. Forward, dK and dV are right; dQ is silently wrong (docs/attention.md: the gradient
check failed at 72 and 80 on the H100 and the H200). Upstream's fix (Dao-AILab/flash-attention pull
request 2896; not in a release up to 4.0.0b40) rounds to 32 in the kernel class too, as this patch does
after its __init__, for code that still rounds to 16. Not under FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1:
compiled kernels kept on disk are keyed by the package's sources and the call's arguments, so a kernel
compiled without the fix would be loaded again.

Nothing runs on trust: the layers take flash-attn-4 at a head dim only once `megatron-hetero kernels
check attention` found its gradients right on that GPU model, and on Hopper at 72 and 80 only where
the backward is fixed here (models/attention_kernels.py: checked_head_dims); elsewhere they stay
zero-padded to 96 or on SDPA.
"""

import inspect

from megatron_hetero.models.attention_kernels import DQ_MULTIPLE, rounds_to_16, sm90_backward_class
from megatron_hetero.patches._patch import replace

KERNEL = "flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90.__init__"


def _init(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.dKV_swapAB:  # rounded to 64 on both sides: right
            return
        bound = signature.bind(self, *args, **kwargs)
        head_dim = bound.arguments["head_dim"]
        head_dim_v = bound.arguments.get("head_dim_v") or head_dim
        self.tile_hdim, self.tile_hdimv = (-(-d // DQ_MULTIPLE) * DQ_MULTIPLE for d in (head_dim, head_dim_v))
        self.check_hdim_oob = head_dim != self.tile_hdim
        self.check_hdim_v_oob = head_dim_v != self.tile_hdimv
        self.shuffle_LSE = self.shuffle_dPsum = self.SdP_swapAB and self.tile_hdim <= 64
    return __init__


def _kernel_class():
    """flash-attn-4's Hopper backward kernel class where the patch is for this install, else None."""
    kernel = sm90_backward_class()
    if kernel is None:
        return None
    from flash_attn.cute import cache_utils

    unfixed = rounds_to_16(inspect.unwrap(kernel.__init__))
    return kernel if unfixed and not cache_utils.CUTE_DSL_CACHE_ENABLED else None


def applies() -> bool:
    """Whether apply() changes flash-attn-4 here (installed, unfixed, no kernels cached on disk)."""
    return _kernel_class() is not None


def apply() -> None:
    if applies():
        replace(KERNEL, _init, params=("self", "head_dim", "head_dim_v"))
