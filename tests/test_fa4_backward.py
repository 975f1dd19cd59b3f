"""patches/fa4_backward.py: flash-attn-4's Hopper backward kernel class rounds its tiles' head dim to 32,
as its interface rounds the dQ (and dK/dV) accumulators it allocates and reads back, where the releases
round to 16 (head dims 72 and 80: tiles of 80, accumulators of 96, dQ wrong). On a stand-in with the
release's __init__ (its rounding lines, signature and the attributes the tiles decide); the kernels
themselves are checked on a GPU by `megatron-hetero kernels check attention`."""

import importlib.util
import math

import pytest

from megatron_hetero.patches import fa4_backward


class Release:
    """FlashAttentionBackwardSm90.__init__ of flash-attn-4 4.0.0b36-b40, the lines that set the tiles."""

    def __init__(self, dtype, head_dim, head_dim_v=None, qhead_per_kvhead=1, is_causal=False, *,
                 SdP_swapAB=False, dKV_swapAB=False):
        hdim_multiple_of = 64 if dKV_swapAB else 16
        self.tile_hdim = int(math.ceil(head_dim / hdim_multiple_of) * hdim_multiple_of)
        head_dim_v = head_dim_v if head_dim_v is not None else head_dim
        self.tile_hdimv = int(math.ceil(head_dim_v / hdim_multiple_of) * hdim_multiple_of)
        self.check_hdim_oob = head_dim != self.tile_hdim
        self.check_hdim_v_oob = head_dim_v != self.tile_hdimv
        self.SdP_swapAB, self.dKV_swapAB = SdP_swapAB, dKV_swapAB
        self.shuffle_LSE = self.SdP_swapAB and self.tile_hdim <= 64
        self.shuffle_dPsum = self.SdP_swapAB and self.tile_hdim <= 64


def interface_rounding(head_dim: int, dKV_swapAB: bool) -> int:
    """The interface's head_dim_rounded on sm90: the accumulators' width."""
    multiple = 64 if dKV_swapAB else 32
    return (head_dim + multiple - 1) // multiple * multiple


class Patched(Release):
    pass


Patched.__init__ = fa4_backward._init(Release.__init__)
Patched.__init__.__wrapped__ = Release.__init__  # as patches/_patch.py's replace() keeps the original


@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 104, 128])
@pytest.mark.parametrize("dKV_swapAB", [False, True])
def test_the_tiles_match_the_accumulators_the_interface_allocates(head_dim, dKV_swapAB):
    release = Release("bf16", head_dim, dKV_swapAB=dKV_swapAB)
    patched = Patched("bf16", head_dim, dKV_swapAB=dKV_swapAB)
    assert patched.tile_hdim == patched.tile_hdimv == interface_rounding(head_dim, dKV_swapAB)
    assert patched.check_hdim_oob == (head_dim != patched.tile_hdim)
    if head_dim % 32 == 0 or dKV_swapAB:  # where the release is right, the patch changes nothing
        assert vars(patched) == vars(release)
    else:  # the release's mismatch: tiles of 80 (72, 80) or 112 (104) against accumulators 16 wider
        assert release.tile_hdim == interface_rounding(head_dim, dKV_swapAB) - 16


def test_head_dim_v_and_the_statistics_layout_follow_the_tiles():
    patched = Patched("bf16", 64, 72, SdP_swapAB=True)
    assert (patched.tile_hdim, patched.tile_hdimv, patched.check_hdim_v_oob) == (64, 96, True)
    assert patched.shuffle_LSE and patched.shuffle_dPsum  # tile_hdim 64: as the release decides
    assert not Patched("bf16", 72, SdP_swapAB=True).shuffle_LSE


def test_only_releases_that_round_to_16_are_patched():
    assert fa4_backward.rounds_to_16(Release.__init__)
    assert not fa4_backward.rounds_to_16(interface_rounding)
    assert not fa4_backward.rounds_to_16(len)  # no Python source to read
    if importlib.util.find_spec("flash_attn") is None:
        assert not fa4_backward.applies()
