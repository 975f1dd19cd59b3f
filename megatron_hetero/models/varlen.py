"""Attention within the items of a packed sequence: native-resolution encoders (Qwen2.5-VL's ViT)
run every image of a rank in one call, their tokens back to back, each image attending to itself
only (and, in windowed layers, each window to itself). The segments are given as cu_seqlens
([segments + 1] cumulative token counts, flash-attention's convention).

`varlen_attention` is the one function that computes it: here torch's SDPA, one call per distinct
segment length (the segments of a length stacked into a batch: windows are mostly of one size, so a
few calls per layer, and no mask is materialized); flash-attn's varlen entry (issue 30) replaces it
on GPUs. `SegmentAttention` is a megatron-core core attention (DotProductAttention's constructor and
forward) that calls it with the segments its layer uses: whole items, or windows in a windowed layer.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Bidirectional attention of q, k, v [t, heads, d] within each segment of cu_seqlens (int,
    [segments + 1], from 0 to t); returns [t, heads, d]."""
    bounds = cu_seqlens.tolist()
    starts, lengths = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    outs, order = [], []
    for length in lengths.unique().tolist():
        if length == 0:
            continue
        index = (starts[lengths == length][:, None] + torch.arange(length)).to(q.device)  # [n, length]
        # [n, length, heads, d] -> [n, heads, length, d]
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2).flatten(0, 1))
        order.append(index.flatten())
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs)[torch.cat(order).argsort()]


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

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: SegmentParams | None = None) -> torch.Tensor:
        if not isinstance(packed_seq_params, SegmentParams) or query.shape[1] != 1:
            raise ValueError("SegmentAttention takes a packed sequence [t, 1, ...] and its SegmentParams")
        segments = packed_seq_params.cu_seqlens_q
        if self.windowed and packed_seq_params.windows is not None:
            segments = packed_seq_params.windows
        out = varlen_attention(query[:, 0], key[:, 0], value[:, 0], segments, self.softmax_scale)
        return out.flatten(1)[:, None]
