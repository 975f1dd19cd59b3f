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
check attention` found its gradients right on that GPU model (models/attention_kernels.py); until then
72 and 80 stay zero-padded to 96 or on SDPA, as before.
"""

import importlib.util
import inspect

from megatron_hetero.patches._patch import replace

KERNEL = "flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90.__init__"
UNFIXED = "64 if dKV_swapAB else 16"  # the tiles' rounding in the releases the patch is for
MULTIPLE = 32  # the interface's rounding of the dQ and dK/dV accumulators without swapped dK/dV


def rounds_to_16(init) -> bool:
    """Whether the kernel class's __init__ still rounds the tiles' head dim to 16 (False where its source
    cannot be read: nothing is changed without seeing the line it fixes)."""
    try:
        return UNFIXED in inspect.getsource(init)
    except (OSError, TypeError):
        return False


def _init(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.dKV_swapAB:  # rounded to 64 on both sides: right
            return
        bound = signature.bind(self, *args, **kwargs)
        head_dim = bound.arguments["head_dim"]
        head_dim_v = bound.arguments.get("head_dim_v") or head_dim
        self.tile_hdim, self.tile_hdimv = (-(-d // MULTIPLE) * MULTIPLE for d in (head_dim, head_dim_v))
        self.check_hdim_oob = head_dim != self.tile_hdim
        self.check_hdim_v_oob = head_dim_v != self.tile_hdimv
        self.shuffle_LSE = self.shuffle_dPsum = self.SdP_swapAB and self.tile_hdim <= 64
    return __init__


def _kernel_class():
    """flash-attn-4's Hopper backward kernel class where the patch is for this install, else None."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn.cute import cache_utils
        from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    except Exception:  # the CuTe DSL failing to load: no flash-attn-4 here at all (attention_kernels says why)
        return None
    unfixed = rounds_to_16(inspect.unwrap(FlashAttentionBackwardSm90.__init__))
    return FlashAttentionBackwardSm90 if unfixed and not cache_utils.CUTE_DSL_CACHE_ENABLED else None


def applies() -> bool:
    """Whether apply() changes flash-attn-4 here (installed, unfixed, no kernels cached on disk)."""
    return _kernel_class() is not None


def apply() -> None:
    if applies():
        replace(KERNEL, _init, params=("self", "head_dim", "head_dim_v"))
