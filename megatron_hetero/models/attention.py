"""Core attention for megatron-core layer specs without Transformer Engine, on torch's
scaled_dot_product_attention (flash / memory-efficient kernels on GPUs), with context parallelism.

Causal attention with CP: the local sequence is Megatron's load-balanced layout (chunks r and
2cp-1-r of 2cp, see context_parallel.py). Keys and values are all-gathered over the CP group
(backward: reduce-scatter), put in sequence order, and each local chunk's queries attend to the key
prefix that ends at the chunk's last position, with a bottom-right-aligned causal mask. No mask is
materialized where the kernel can avoid it. The caller's attention_mask is ignored for causal
attention; for padding / arbitrary / no_mask an explicit mask is honoured (True = masked out,
megatron's convention), which needs CP = 1.

Packed sequences (several samples back to back in one sequence): megatron-core's PackedSeqParams
with qkv_format "sbhd" and `seq_idx` [b, s], the sample (document) of every position of the whole
sequence. A query attends to the keys before it of its own document only, with or without CP (a
mask from the documents at the local queries' global positions and at every key's). RoPE keeps the
packed positions: attention scores depend on the distance between positions only, so a document's
scores equal its unpacked ones.
"""

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention.bias import causal_lower_right

from megatron_hetero.models.context_parallel import cp_gathered_to_sequence_order, cp_positions

_CAUSAL = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)
_MASK_OPTIONAL = (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary)


def _causal_attention(q, k, v, **sdpa_kwargs):
    """Causal attention of queries q [b, h, sq, d] at the last sq of the sk positions of k, v."""
    sq, sk = q.shape[-2], k.shape[-2]
    if sq == sk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa_kwargs)
    # Query i sees keys up to sk - sq + i (flash and memory-efficient kernels handle this variant).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), **sdpa_kwargs)


def _document_mask(documents: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """[b, 1, local queries, keys] True where a query may attend: an earlier (or its own) position of
    its own document. documents: [b, s] over the whole sequence; the queries are the CP rank's."""
    s = documents.shape[1]
    queries = cp_positions(s, cp, cp_rank, documents.device)
    keys = torch.arange(s, device=documents.device)
    same = documents[:, queries, None] == documents[:, None, :]
    return (same & (keys[None, :] <= queries[:, None]))[:, None]


class SDPAttention(MegatronModule):
    """Drop-in for megatron-core's DotProductAttention (same constructor and forward), supporting
    context parallelism for causal attention. [s, b, heads, hn] in, [s, b, heads * hn] out;
    grouped-query attention by repeating key/value heads (after the CP gather: fewer bytes)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,  # any: keys and values are always all-gathered
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            raise ValueError("SDPAttention needs pg_collection (for its cp group)")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("SDPAttention supports neither window_size nor softmax_type other than vanilla")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.cp_group = pg_collection.cp
        self.cp = 1 if self.cp_group is None else self.cp_group.size()
        if self.cp > 1 and attn_mask_type not in _CAUSAL:
            raise ValueError(f"context parallelism needs causal attention, not {attn_mask_type.name}")
        # apply_query_key_layer_scaling divides the scale and multiplies the scores back in
        # megatron's softmax: no change to the result, so the plain scale is used.
        self.softmax_scale = config.kv_channels**-0.5 if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        packed = packed_seq_params
        if packed is not None and (packed.qkv_format != "sbhd" or packed.seq_idx is None or mask_type not in _CAUSAL):
            raise ValueError("SDPAttention takes packed sequences as qkv_format 'sbhd' with seq_idx (the document of "
                             "every position, [b, s]) and causal attention")
        if mask_type not in _CAUSAL + _MASK_OPTIONAL:
            raise ValueError(f"SDPAttention does not support attn_mask_type {mask_type.name}")
        if self.cp > 1:
            if mask_type not in _CAUSAL:
                raise ValueError(f"context parallelism needs causal attention, not {mask_type.name}")
            key, value = (
                cp_gathered_to_sequence_order(
                    gather_from_sequence_parallel_region(t, group=self.cp_group), self.cp
                )
                for t in (key, value)
            )
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        sdpa_kwargs = dict(dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale)
        # Dropout in a TP region draws from the TP-rank-specific stream, as megatron's attention does.
        dropout_rng = (
            get_cuda_rng_tracker().fork()
            if sdpa_kwargs["dropout_p"] > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with dropout_rng:
            if packed is not None:
                mask = _document_mask(packed.seq_idx, self.cp, self.cp_group.rank() if self.cp > 1 else 0)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_kwargs)
            elif mask_type not in _CAUSAL:
                mask = None if attention_mask is None else ~attention_mask
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_kwargs)
            elif self.cp == 1:
                out = _causal_attention(q, k, v, **sdpa_kwargs)
            else:
                out = self._cp_causal_attention(q, k, v, sdpa_kwargs)
        # [b, heads, s, hn] -> [s, b, heads * hn]
        return out.permute(2, 0, 1, 3).flatten(2)

    def _cp_causal_attention(self, q, k, v, sdpa_kwargs) -> torch.Tensor:
        """Local queries (chunks r and 2cp-1-r) against the whole sequence's keys, in order."""
        chunk = q.shape[2] // 2
        r = self.cp_group.rank()
        outs = []
        for half, chunk_index in enumerate((r, 2 * self.cp - 1 - r)):
            keys_end = (chunk_index + 1) * chunk
            outs.append(
                _causal_attention(
                    q[:, :, half * chunk : (half + 1) * chunk],
                    k[:, :, :keys_end],
                    v[:, :, :keys_end],
                    **sdpa_kwargs,
                )
            )
        return torch.cat(outs, dim=2)
