"""Attention within the items of a packed sequence: native-resolution encoders (Qwen2.5-VL's ViT)
run every image of a rank in one call, their tokens back to back, each image attending to itself
only (and, in windowed layers, each window to itself). The segments are given as cu_seqlens
([segments + 1] cumulative token counts, flash-attention's convention).

`SegmentAttention` is a megatron-core core attention (DotProductAttention's constructor and forward)
that runs models/attention.py's `varlen_attention` (flash-attn-4's varlen entry where the module's
kernel choice allows it, else torch SDPA, the segments of each length in one batched call) over the
segments its layer uses: whole items, or windows in a windowed layer.
"""

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.attention import varlen_attention
from megatron_hetero.models.attention_kernels import config_dtype, kernel_for


@dataclass
class SegmentParams(PackedSeqParams):
    """The segments of a packed encoder sequence [t, 1, h] (qkv_format "sbhd", batch 1):
    `cu_seqlens_q` (= `cu_seqlens_kv`) the items, `windows` the windows of the windowed layers
    (None: every layer attends within whole items)."""

    windows: torch.Tensor | None = None

    @staticmethod
    def of(items: torch.Tensor, windows: torch.Tensor | None = None) -> "SegmentParams":
        return SegmentParams(qkv_format="sbhd", cu_seqlens_q=items, cu_seqlens_kv=items, windows=windows)


class SegmentAttention(MegatronModule):
    """Drop-in for megatron-core's DotProductAttention in an encoder layer: [t, 1, heads, d] in,
    [t, 1, heads * d] out, each token attending to its segment of `packed_seq_params`
    (SegmentParams): the whole item, or in a layer not in `full_layers` (0-based global layer
    indices; None: all) its window."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, full_layers: frozenset | None = None):
        super().__init__(config=config)
        if (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("SegmentAttention has no attention dropout; set attention_dropout 0")
        self.windowed = full_layers is not None and layer_number - 1 not in full_layers
        self.softmax_scale = config.kv_channels**-0.5 if softmax_scale is None else softmax_scale
        self.kernel = kernel_for(config.attention_backend, config.kv_channels, config_dtype(config), 0.0,
                                 config.flash_attention_version)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: SegmentParams | None = None) -> torch.Tensor:
        if not isinstance(packed_seq_params, SegmentParams) or query.shape[1] != 1:
            raise ValueError("SegmentAttention takes a packed sequence [t, 1, ...] and its SegmentParams")
        segments = packed_seq_params.cu_seqlens_q
        if self.windowed and packed_seq_params.windows is not None:
            segments = packed_seq_params.windows
        longest = int(segments.diff().max()) if len(segments) > 1 else 0  # on the host: the grids' own
        segments = segments.to(device=query.device, dtype=torch.int32)
        out = varlen_attention(query[:, 0], key[:, 0], value[:, 0], segments, segments, longest, longest,
                               self.kernel, self.softmax_scale)
        return out.flatten(1)[:, None]
