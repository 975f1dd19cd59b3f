"""Core attention for megatron-core layer specs without Transformer Engine, with context parallelism,
on torch's scaled_dot_product_attention or, where attention_kernels.py chooses it for the module
(--attention-backend, the GPU, the head dim), flash-attn-4 (FA4). Both kernels get the same
queries, keys and masks below; FA4 takes [b, s, heads, d] and groups of query heads natively.

Causal attention with CP: the local sequence is Megatron's load-balanced layout (chunks r and
2cp-1-r of 2cp, see context_parallel.py). Keys and values are all-gathered over the CP group
(backward: reduce-scatter), put in sequence order, and each local chunk's queries attend to the key
prefix that ends at the chunk's last position, with a bottom-right-aligned causal mask (FA4's
causal mask is bottom-right aligned too). No mask is materialized where the kernel can avoid it. The
caller's attention_mask is ignored for causal attention; for padding / arbitrary / no_mask an
explicit mask is honoured (True = masked out, megatron's convention) on SDPA, which needs CP = 1.

Full (no_mask) attention with CP, an encoder's: each CP rank holds a contiguous part of every
item's tokens (models/encoder.py); keys and values are all-gathered over the CP group the same way
and every local query attends to all of them.

Packed sequences (several samples back to back in one sequence): megatron-core's PackedSeqParams
with qkv_format "sbhd", `seq_idx` [b, s], the sample (document) of every position of the whole
sequence, and `cu_seqlens_q` its document boundaries over the flattened [b * s] (packed_seq_params()
builds both). A query attends to the keys before it of its own document only, with or without CP:
on SDPA through a mask from the documents at the local queries' global positions and at every
key's; on FA4 through its variable-length entry, each document's part of a local chunk one segment
against its keys up to the chunk's end. RoPE keeps the packed positions: attention scores depend on
the distance between positions only, so a document's scores equal its unpacked ones.

Callers with their own segments (a native-resolution ViT's packed images) use models/varlen.py's
varlen_attention, on the same kernels.
"""

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention.bias import causal_lower_right

from megatron_hetero.models import attention_input, kernel_policy
from megatron_hetero.models.attention_kernels import (
    FA4,
    Fa4,
    KernelChoice,
    config_dtype,
    kernel_for,
    load_fa4,
    run_fa4,
)
from megatron_hetero.models.chunk_attention import chunk_kernel, prefix_causal_attention
from megatron_hetero.models.context_parallel import cp_gathered_to_sequence_order, cp_positions
from megatron_hetero.models.packed_attention import PackedSelfAttention

_CAUSAL = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)
_MASK_OPTIONAL = (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary)


def causal_attention(q, k, v, merged: bool = False, **sdpa_kwargs):
    """Causal attention of queries q [b, h, sq, d] at the last sq of the sk positions of k, v; merged:
    sq < sk as two merged calls (KernelChoice.merged_chunks; no dropout)."""
    sq, sk = q.shape[-2], k.shape[-2]
    if sq == sk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa_kwargs)
    # Query i sees keys up to sk - sq + i: two merged calls (chunk_attention.py), else SDPA's
    # bottom-right mask (its flash and memory-efficient kernels handle this variant).
    if merged:
        return prefix_causal_attention(q, k, v, chunk_kernel(q.device.type), sdpa_kwargs.get("scale"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), **sdpa_kwargs)


def _document_mask(documents: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """[b, 1, local queries, keys] True where a query may attend: an earlier (or its own) position of
    its own document. documents: [b, s] over the whole sequence; the queries are the CP rank's."""
    s = documents.shape[1]
    queries = cp_positions(s, cp, cp_rank, documents.device)
    keys = torch.arange(s, device=documents.device)
    same = documents[:, queries, None] == documents[:, None, :]
    return (same & (keys[None, :] <= queries[:, None]))[:, None]


def document_cu_seqlens(documents: torch.Tensor) -> torch.Tensor:
    """int32 [segments + 1]: where each document starts in the flattened [b * s] of documents [b, s]
    (a document is a run of equal ids; a row's start always starts one), and b * s at the end."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    total = torch.tensor([documents.numel()], device=documents.device)
    return torch.cat([starts.flatten().nonzero().squeeze(1), total]).to(torch.int32)


def packed_seq_params(documents: torch.Tensor, device) -> PackedSeqParams:
    """The attention's PackedSeqParams of a packed batch with documents [b, s] (the sample of every
    position of the whole sequence): seq_idx, and the boundaries computed where `documents` is (on
    the host for a loader's batch: no device synchronization). max_seqlen is the sequence length:
    megatron-core's RoPE sizes its table from it."""
    s = documents.shape[1]
    cu = document_cu_seqlens(documents).to(device)
    return PackedSeqParams(qkv_format="sbhd", seq_idx=documents.to(device), cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=s, max_seqlen_kv=s)


class QueryChunk(NamedTuple):
    """A run of local queries: local[0]:local[1] of the local sequence, global positions start:end;
    under a causal mask they see the keys 0:end."""

    local: tuple[int, int]
    start: int
    end: int


def query_chunks(seq_len: int, cp: int, cp_rank: int) -> list[QueryChunk]:
    """The CP rank's queries as runs of consecutive global positions: the whole sequence without CP,
    chunks r and 2cp-1-r with it (context_parallel.py)."""
    if cp == 1:
        return [QueryChunk((0, seq_len), 0, seq_len)]
    chunk = seq_len // (2 * cp)
    return [QueryChunk((half * chunk, (half + 1) * chunk), index * chunk, (index + 1) * chunk)
            for half, index in enumerate((cp_rank, 2 * cp - 1 - cp_rank))]


def chunk_cu_seqlens(cu: torch.Tensor, seq_len: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents cu [n + 1] over the flattened [b * seq_len] cut to a query chunk [start, end) of every
    row: (cu_q over [b * (end - start)] queries, cu_k over [b * end] keys 0:end of every row). Segment
    i is document i's queries in the chunk against its keys before the chunk's end: both end at the
    same position, so a bottom-right causal mask lets a query see its document's earlier keys; a
    document outside the chunk is an empty segment. Device-side, no synchronization."""
    first, last = cu[:-1].long(), cu[1:].long()
    row = first // seq_len  # documents never cross rows
    first, last = first - row * seq_len, last - row * seq_len
    queries = last.clamp(start, end) - first.clamp(start, end)
    keys = last.clamp(0, end) - first.clamp(0, end)
    return tuple(F.pad(n.cumsum(0), (1, 0)).to(torch.int32) for n in (queries, keys))


def _fa4_documents(fa4: Fa4, kernel: KernelChoice, q, k, v, cu, chunks, scale) -> torch.Tensor:
    """Per-document causal attention through FA4's varlen entry, one call per query chunk.
    q [b, s_local, h, d], k, v [b, s, hk, d] (the whole sequence) -> [b, s_local, h, d]."""
    b, s = k.shape[:2]
    outs = []
    for (a, e), start, end in chunks:
        cu_q, cu_k = chunk_cu_seqlens(cu, s, start, end)
        keys = [t[:, :end].reshape(b * end, *t.shape[2:]) for t in (k, v)]
        out = run_fa4(fa4.varlen_func, kernel, q[:, a:e].reshape(b * (e - a), *q.shape[2:]), *keys,
                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=e - a, max_seqlen_k=end,
                      softmax_scale=scale, causal=True)
        outs.append(out.view(b, e - a, *out.shape[1:]))
    return torch.cat(outs, dim=1)


def _attend_fa4(fa4: Fa4, kernel: KernelChoice, q, k, v, causal, packed, chunks, scale) -> torch.Tensor:
    """q [s_local, b, h, d], k, v [s, b, hk, d] -> [s_local, b, h, d] on FA4 (the dense calls' outputs
    in [s, b] memory order as their queries: Fa4.func)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    if packed is not None:
        return _fa4_documents(fa4, kernel, q, k, v, packed.cu_seqlens_q, chunks, scale).transpose(0, 1)
    if not causal:
        return run_fa4(fa4.func, kernel, q, k, v, softmax_scale=scale, causal=False).transpose(0, 1)
    outs = [run_fa4(fa4.func, kernel, q[:, a:e], k[:, :end], v[:, :end], softmax_scale=scale, causal=True)
            .transpose(0, 1) for (a, e), _, end in chunks]
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # cat copies even one tensor


def _attend_sdpa(q, k, v, causal, mask, packed, cp, cp_rank, chunks, merged, **sdpa_kwargs) -> torch.Tensor:
    """q [s_local, b, h, d], k, v [s, b, hk, d] -> [b, h, s_local, d] on torch SDPA; merged: the later
    chunks as merged calls."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:  # after the CP gather: fewer bytes gathered
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if packed is not None:
        mask = _document_mask(packed.seq_idx, cp, cp_rank)
    if packed is not None or not causal:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_kwargs)
    return torch.cat([causal_attention(q[:, :, a:e], k[:, :, :end], v[:, :, :end], merged, **sdpa_kwargs)
                      for (a, e), _, end in chunks], dim=2)


def attend(q, k, v, kernel: KernelChoice, scale: float, causal: bool, mask: torch.Tensor | None = None,
           packed: PackedSeqParams | None = None, cp: int = 1, cp_rank: int = 0, dropout: float = 0.0,
           fa4: Fa4 | None = None) -> torch.Tensor:
    """Attention of a CP rank's queries q [s_local, b, h, d] over the whole sequence's keys and values
    k, v [s, b, hk, d] (gathered, in sequence order) -> [s_local, b, h * d]. causal: bottom-right
    aligned per query chunk (query_chunks); otherwise `mask` (True = may attend; SDPA only) or none;
    packed: per document. kernel: the module's choice; fa4: FA4's entries (default: the installed ones;
    tests pass a stand-in). FA4 runs neither an explicit mask nor dropout."""
    chunks = query_chunks(k.shape[0], cp, cp_rank)
    if kernel.kernel == FA4 and mask is None and dropout == 0.0:
        return _attend_fa4(fa4 or load_fa4()[0], kernel, q, k, v, causal, packed, chunks, scale).flatten(2)
    merged = kernel.merged_chunks and dropout == 0.0
    out = _attend_sdpa(q, k, v, causal, mask, packed, cp, cp_rank, chunks, merged, dropout_p=dropout, scale=scale)
    return out.permute(2, 0, 1, 3).flatten(2)


class SDPAttention(MegatronModule):
    """Drop-in for megatron-core's DotProductAttention (same constructor and forward), supporting
    context parallelism for causal attention. [s, b, heads, hn] in, [s, b, heads * hn] out;
    grouped-query attention by repeating key/value heads on SDPA (after the CP gather: fewer bytes),
    natively on FA4. `kernel`: this module's kernel choice (attention_kernels.kernel_for)."""

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
        if self.cp > 1 and attn_mask_type not in _CAUSAL + (AttnMaskType.no_mask,):
            raise ValueError(f"context parallelism needs causal attention or none, not {attn_mask_type.name}")
        # apply_query_key_layer_scaling divides the scale and multiplies the scores back in
        # megatron's softmax: no change to the result, so the plain scale is used.
        self.softmax_scale = config.kv_channels**-0.5 if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernel = kernel_for(kernel_policy.of(config), config.kv_channels, config_dtype(config), self.dropout_p)

    def _gather_cp(self, t: torch.Tensor, causal: bool) -> torch.Tensor:
        """Keys or values of the whole sequence from every CP rank's part: in sequence order from
        the load-balanced chunks under a causal mask; in rank order without one (an encoder's
        contiguous parts, and full attention does not depend on the keys' order)."""
        gathered = gather_from_sequence_parallel_region(t, group=self.cp_group)
        return cp_gathered_to_sequence_order(gathered, self.cp) if causal else gathered

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
        if packed is not None and (packed.qkv_format != "sbhd" or packed.seq_idx is None
                                   or packed.cu_seqlens_q is None or mask_type not in _CAUSAL):
            raise ValueError("SDPAttention takes packed sequences as qkv_format 'sbhd' with seq_idx and "
                             "cu_seqlens_q (models.attention.packed_seq_params) and causal attention")
        if mask_type not in _CAUSAL + _MASK_OPTIONAL:
            raise ValueError(f"SDPAttention does not support attn_mask_type {mask_type.name}")
        causal = mask_type in _CAUSAL
        if self.cp > 1:
            if not causal and (mask_type != AttnMaskType.no_mask or attention_mask is not None):
                raise ValueError(f"context parallelism needs causal attention or none, not {mask_type.name}")
            key, value = (self._gather_cp(t, causal) for t in (key, value))
        mask = None if causal or attention_mask is None else ~attention_mask
        dropout = self.dropout_p if self.training else 0.0
        # Dropout in a TP region draws from the TP-rank-specific stream, as megatron's attention does.
        dropout_rng = (
            get_cuda_rng_tracker().fork()
            if dropout > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with dropout_rng:
            return attend(query, key, value, self.kernel, self.softmax_scale, causal, mask, packed, self.cp,
                          self.cp_group.rank() if self.cp > 1 else 0, dropout)


def attention_summary(module: torch.nn.Module) -> str:
    """What a model part's core attention runs, for the start-up line and benchmark records: our
    kernel choices (e.g. "fa4 (head dim 128)"; under CP on SDPA, how the later chunks run), or the
    class of another core attention (Transformer Engine's); "none" for a part without attention; the
    packed layers' attention input where it runs on Triton (attention_input.SUMMARY, last)."""
    found, input_on_triton = [], False
    for name, sub in module.named_modules():
        if isinstance(sub, PackedSelfAttention):
            input_on_triton |= sub.fused and sub.on_triton
        if name.endswith("core_attention"):
            if hasattr(sub, "kernel"):  # ours; a packed encoder's (varlen.SegmentAttention) runs no CP
                found.append(sub.kernel.describe(getattr(sub, "cp", 1)))
                short = getattr(sub, "short_kernel", sub.kernel)
                if getattr(sub, "windowed", False) and short != sub.kernel:
                    found.append(f"windows: {short}")
            else:
                found.append(type(sub).__name__)
    if input_on_triton and attention_input.HAVE_TRITON and torch.cuda.is_available():
        found.append(attention_input.SUMMARY)
    return "; ".join(dict.fromkeys(found)) or "none"
