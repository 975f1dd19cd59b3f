"""Attention within the segments of a packed sequence: native-resolution encoders (Qwen2.5-VL's and
Qwen3-VL's ViTs) run every image of a rank in one call, their tokens back to back, each image
attending to itself only (and, in windowed layers, each window to itself). The segments are given as
cu_seqlens ([segments + 1] cumulative token counts, flash-attention's convention).

The segments are planned once per forward, on the host where the images' grids are, and reach the
device in one pinned copy with the family's own tables (`VarlenPlan`, `SegmentParams.of`): every
layer then runs without host work, host-to-device copies or synchronizations (a profile of
Qwen2.5-VL-7B's ViT showed ~320 pageable copies, 32 synchronizations and ~660 fills per forward
when each layer planned its own segments).

`varlen_attention` runs flash-attn-4's varlen entry (one launch for every segment) where the module's
kernel choice allows it, for calls of short segments only (windows: attention_kernels.SHORT_SEGMENTS)
ours on Triton (short_attention.py) or torch's own varlen flash-attention, else torch SDPA: the tokens
permuted once so that the segments of each shape lie together (one gather each way, forward and
backward), one batched call per shape on views.

`SegmentAttention` is a megatron-core core attention (DotProductAttention's constructor and forward)
that runs `varlen_attention` over the segments its layer uses: whole items, or windows in a windowed
layer (`SegmentParams`).

With context parallelism (`CPSplit`) each CP rank holds whole merge blocks of every item, item i's
blocks [c*B_i//cp, (c+1)*B_i//cp) (the rows the boundary takes from it: boundary/plan.py), in the
layers' order (windows'); attention all-gathers keys and values over the CP group (each rank's part
padded to the longest) and puts them in the layers' order, and each segment's local queries attend
to all of its keys: the same scores as without CP, whatever a window's or item's split.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models import kernel_policy
from megatron_hetero.models.attention import causal_attention
from megatron_hetero.models.attention_kernels import (
    FA4,
    SHORT_SEGMENTS,
    TORCH_FLASH,
    TRITON_SHORT,
    Fa4,
    KernelChoice,
    TorchFlash,
    config_dtype,
    kernel_for,
    load_fa4,
    run_fa4,
    torch_flash_varlen,
)
from megatron_hetero.models.short_attention import short_attention
from megatron_hetero.models.transfer import to_device


class Permute(torch.autograd.Function):
    """forward: x[order] along dim 0; backward: grad[inverse] (order a permutation, inverse its
    inverse): one gather each way, where indexing's backward would fill zeros and scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute(x: torch.Tensor, order: torch.Tensor | None, inverse: torch.Tensor | None) -> torch.Tensor:
    """x[order] along dim 0 (order None: x itself), differentiable by Permute."""
    return x if order is None else Permute.apply(x, order, inverse)


def _grouped_order(lengths: torch.Tensor, shape: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(order, inverse) long [tokens]: the tokens of segments with `lengths` (host), those of each
    `shape` (a key per segment, ordered as `_shape_groups`) together; (None, None) where they are."""
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    order = torch.sort(shape[owner], stable=True).indices  # keeps segments and their tokens in order
    if bool((order == torch.arange(len(order))).all()):
        return None, None
    return order, torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))


def _shape_groups(lengths_q: torch.Tensor, lengths_k: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """((query length, key length, segments), ...) by query length then key length."""
    shapes, counts = torch.stack([lengths_q, lengths_k], 1).unique(dim=0, return_counts=True)
    return tuple((lq, lk, n) for (lq, lk), n in zip(shapes.tolist(), counts.tolist()))


@dataclass(frozen=True)
class VarlenPlan:
    """Segments of packed queries and keys, planned once for every layer that attends within them:
    cu_q, cu_k int32 [segments + 1] on the device (flash-attn-4's varlen entry); max_q, max_k the
    longest segments; for SDPA, `groups` ((lq, lk, segments) per shape) and the permutations that
    put each shape's queries (order_q, inverse_q) and keys (order_k, inverse_k) together (None:
    already so)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    groups: tuple[tuple[int, int, int], ...]
    order_q: torch.Tensor | None = None
    inverse_q: torch.Tensor | None = None
    order_k: torch.Tensor | None = None
    inverse_k: torch.Tensor | None = None

    @staticmethod
    def of(cu_q: torch.Tensor, cu_k: torch.Tensor | None = None) -> "VarlenPlan":
        """The plan of cu_seqlens cu_q, cu_k (cu_k None: the keys' segments are the queries'), on the
        host (device tensors are read back: one synchronization); `plans_to` moves it."""
        same = cu_k is None
        cu_q = cu_q.cpu().long()
        cu_k = cu_q if same else cu_k.cpu().long()
        lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
        shape = lengths_q * (int(cu_k[-1]) + 1) + lengths_k  # (lq, lk) in lexicographic order
        order_q, inverse_q = _grouped_order(lengths_q, shape)
        order_k, inverse_k = (order_q, inverse_q) if same else _grouped_order(lengths_k, shape)
        cu_q = cu_q.int()
        longest = [int(n.max()) if len(n) else 0 for n in (lengths_q, lengths_k)]
        return VarlenPlan(cu_q, cu_q if same else cu_k.int(), *longest, _shape_groups(lengths_q, lengths_k),
                          order_q, inverse_q, order_k, inverse_k)


_PLAN_TENSORS = ("cu_q", "cu_k", "order_q", "inverse_q", "order_k", "inverse_k")


def plans_to(device, plans: list[VarlenPlan], extra: list[torch.Tensor] = ()) -> tuple[list, list]:
    """(plans, extra host tensors) on `device` in one copy (to_device), a tensor shared within or
    between plans moved once."""
    unique = {id(t): t for p in plans for t in (getattr(p, n) for n in _PLAN_TENSORS) if t is not None}
    moved = to_device([*unique.values(), *extra], device)
    on_device = dict(zip(unique, moved))
    plans = [replace(p, **{n: on_device[id(getattr(p, n))] for n in _PLAN_TENSORS if getattr(p, n) is not None})
             for p in plans]
    return plans, moved[len(unique):]


def _varlen_sdpa(q, k, v, plan: VarlenPlan, scale, causal, merged) -> torch.Tensor:
    """varlen_attention on torch SDPA: one batched call per segment shape, on views of the permuted
    queries and keys; a segment without keys gives zeros, as flash-attn-4; merged: segments with more
    keys than queries as merged calls (KernelChoice.merged_chunks)."""
    qs = permute(q, plan.order_q, plan.inverse_q).split([lq * n for lq, _, n in plan.groups])
    ks, vs = (permute(t, plan.order_k, plan.inverse_k).split([lk * n for _, lk, n in plan.groups]) for t in (k, v))
    outs = []
    for (lq, lk, n), qg, kg, vg in zip(plan.groups, qs, ks, vs):
        if lq == 0 or lk == 0:
            outs.append(qg.new_zeros(lq * n, qg.shape[1], vg.shape[-1]))
            continue
        # [n * l, heads, d] -> [n, heads, l, d]
        qg, kg, vg = (t.view(n, -1, *t.shape[1:]).transpose(1, 2) for t in (qg, kg, vg))
        if kg.shape[1] != qg.shape[1]:
            kg, vg = (t.repeat_interleave(qg.shape[1] // kg.shape[1], dim=1) for t in (kg, vg))
        part = (causal_attention(qg, kg, vg, merged, scale=scale) if causal
                else F.scaled_dot_product_attention(qg, kg, vg, scale=scale))
        outs.append(part.transpose(1, 2).flatten(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return permute(out, plan.inverse_q, plan.order_q)


def varlen_attention(q, k, v, plan: VarlenPlan, kernel: KernelChoice, softmax_scale: float | None = None,
                     causal: bool = False, fa4: Fa4 | None = None,
                     torch_flash: TorchFlash | None = None) -> torch.Tensor:
    """Attention within the segments of packed sequences, flash-attention's varlen convention:
    q [total_q, heads, d], k, v [total_k, kv heads, d]; segment i's queries q[cu_q[i]:cu_q[i+1]]
    attend to its keys k[cu_k[i]:cu_k[i+1]] (causal: bottom-right aligned, the j-th query of a
    segment sees keys up to len_k - len_q + j); plan: their VarlenPlan on q's device. kernel:
    kernel_for(the module's policy, head dim, dtype, packed=True): FA4's varlen entry (fa4: its
    stand-in in tests), for short segments ours on Triton or torch's varlen flash-attention
    (torch_flash: its stand-in), else torch SDPA per segment shape. Returns [total_q, heads, d]."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if kernel.kernel == TORCH_FLASH:
        return torch_flash_varlen(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale, causal, torch_flash)
    if kernel.kernel == TRITON_SHORT:
        return short_attention(q, k, v, plan.cu_q, plan.cu_k, max(plan.max_q, plan.max_k), scale, causal)
    if kernel.kernel == FA4:
        return run_fa4((fa4 or load_fa4()[0]).varlen_func, kernel, q, k, v, cu_seqlens_q=plan.cu_q,
                       cu_seqlens_k=plan.cu_k, max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k,
                       softmax_scale=scale, causal=causal)
    return _varlen_sdpa(q, k, v, plan, scale, causal, kernel.merged_chunks)


def cp_owners(counts: torch.Tensor, cp: int) -> torch.Tensor:
    """The CP rank of every unit (merge block, row) of items of `counts` units, back to back: item
    i's [c*n_i//cp, (c+1)*n_i//cp) on rank c (boundary/plan.py's split of an item's rows)."""
    counts = counts.long()
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return ((within + 1) * cp - 1) // torch.repeat_interleave(counts, counts)


@dataclass(frozen=True)
class CPSplit:
    """A CP rank's part of packed items, planned on the host (module docstring): `blocks` its merge
    blocks (indices into the packed input's blocks) in the layers' order, `key_index` every token
    of the layers' order in the CP-gathered keys [cp * padded], `local` [tokens] whether this rank
    holds each token of the layers' order, `padded` the most tokens any rank holds."""

    group: object  # the CP process group
    blocks: torch.Tensor
    key_index: torch.Tensor
    local: torch.Tensor
    padded: int

    @staticmethod
    def of(block_counts: torch.Tensor, order: torch.Tensor | None, unit: int, group) -> "CPSplit":
        """block_counts [items]: each item's merge blocks of `unit` tokens, back to back; order
        [blocks]: the layers' order of the blocks (None: the input's)."""
        return CPSplit.owned(cp_owners(block_counts, group.size()), order, unit, group)

    @staticmethod
    def owned(owner: torch.Tensor, order: torch.Tensor | None, unit: int, group) -> "CPSplit":
        """owner [blocks]: the CP rank holding each block of `unit` tokens (in the input's order);
        order as in `of`."""
        cp, rank = group.size(), group.rank()
        order = torch.arange(len(owner)) if order is None else order.long()
        owner = owner[order]
        held = torch.bincount(owner, minlength=cp)
        slot = torch.empty_like(owner)  # a block's place in its rank's part
        for r in range(cp):
            slot[owner == r] = torch.arange(int(held[r]))
        key_blocks = owner * int(held.max()) + slot
        key_index = (key_blocks[:, None] * unit + torch.arange(unit)).flatten()
        local = torch.repeat_interleave(owner == rank, unit)
        return CPSplit(group, order[owner == rank], key_index, local, int(held.max()) * unit)

    def tokens(self, unit: int) -> torch.Tensor:
        """long [local tokens]: this rank's tokens (indices into the packed input) in the layers' order."""
        return (self.blocks[:, None] * unit + torch.arange(unit)).flatten()

    def local_cu(self, cu: torch.Tensor) -> torch.Tensor:
        """Segments `cu` [segments + 1] of the layers' order cut to this rank's tokens."""
        segment = torch.bucketize(torch.arange(len(self.local)), cu[1:].long(), right=True)
        held = torch.bincount(segment[self.local], minlength=len(cu) - 1)
        return F.pad(held.cumsum(0), (1, 0)).to(cu.dtype)


@dataclass
class SegmentParams(PackedSeqParams):
    """The segments of a packed encoder sequence [t, 1, h] (qkv_format "sbhd", batch 1): `items`
    the items' plan (its cu_seqlens also as `cu_seqlens_q` / `cu_seqlens_kv`), `windows` the
    windowed layers' (None: every layer attends within whole items); with CP, `split` this rank's
    part and `key_index` (CPSplit.key_index on the device)."""

    items: VarlenPlan | None = None
    windows: VarlenPlan | None = None
    split: CPSplit | None = None
    key_index: torch.Tensor | None = None

    @staticmethod
    def of(items: torch.Tensor, windows: torch.Tensor | None = None, device="cpu",
           extra: list[torch.Tensor] = (), split: CPSplit | None = None) -> tuple["SegmentParams", list[torch.Tensor]]:
        """From the host cu_seqlens of the items and the windows (in the layers' order), planned once
        for every layer, on `device` with the caller's `extra` host tensors in one copy: (params,
        extra on the device). `split`: this CP rank's part, whose queries attend to every key."""
        cus = [cu for cu in (items, windows) if cu is not None]
        plans = [VarlenPlan.of(cu) if split is None else VarlenPlan.of(split.local_cu(cu), cu) for cu in cus]
        keys = [] if split is None else [split.key_index]
        plans, moved = plans_to(device, plans, [*keys, *extra])
        params = SegmentParams(qkv_format="sbhd", cu_seqlens_q=plans[0].cu_q, cu_seqlens_kv=plans[0].cu_k,
                               items=plans[0], windows=plans[1] if len(plans) > 1 else None, split=split,
                               key_index=moved[0] if split is not None else None)
        return params, moved[len(keys):]

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        """Keys or values [local tokens, heads, d] -> every rank's [tokens, heads, d] in the layers'
        order (with CP; else t itself). Backward: each rank's part of the summed gradients."""
        if self.split is None:
            return t
        padded = F.pad(t, (0, 0, 0, 0, 0, self.split.padded - t.shape[0]))
        every = gather_from_sequence_parallel_region(padded, group=self.split.group)
        return every.index_select(0, self.key_index)


# What SegmentAttention takes; plan() and forward() check a part each.
PACKED_INPUT = "SegmentAttention takes a packed sequence [t, 1, ...] and its SegmentParams"


class SegmentAttention(MegatronModule):
    """Drop-in for megatron-core's DotProductAttention in an encoder layer: [t, 1, heads, d] in,
    [t, 1, heads * d] out, each token attending to its segment of `packed_seq_params`
    (SegmentParams): the whole item, or in a layer not in `full_layers` (0-based global layer
    indices; None: all) its window. `kernel` runs a call's segments, `short_kernel` those of a call
    whose segments are all SHORT_SEGMENTS tokens or fewer (windows; kernel_for's `longest`)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, full_layers: frozenset | None = None):
        super().__init__(config=config)
        if (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("SegmentAttention has no attention dropout; set attention_dropout 0")
        self.windowed = full_layers is not None and layer_number - 1 not in full_layers
        self.softmax_scale = config.kv_channels**-0.5 if softmax_scale is None else softmax_scale
        policy, dtype = kernel_policy.of(config), config_dtype(config)
        self.kernel = kernel_for(policy, config.kv_channels, dtype, packed=True)
        self.short_kernel = kernel_for(policy, config.kv_channels, dtype, packed=True, longest=SHORT_SEGMENTS)

    def plan(self, packed_seq_params: "SegmentParams") -> tuple[VarlenPlan, KernelChoice]:
        """The segments this layer attends within (the items', or a windowed layer's windows) and the
        kernel that runs them."""
        if not isinstance(packed_seq_params, SegmentParams):
            raise ValueError(PACKED_INPUT)
        plan = packed_seq_params.items
        if self.windowed and packed_seq_params.windows is not None:
            plan = packed_seq_params.windows
        short = max(plan.max_q, plan.max_k) <= SHORT_SEGMENTS
        return plan, self.short_kernel if short else self.kernel

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: SegmentParams | None = None) -> torch.Tensor:
        if query.shape[1] != 1:
            raise ValueError(PACKED_INPUT)
        plan, kernel = self.plan(packed_seq_params)
        # squeeze, not [:, 0]: a view both ways (indexing's backward fills zeros and copies, per tensor)
        key, value = (packed_seq_params.gathered(t.squeeze(1)) for t in (key, value))
        out = varlen_attention(query.squeeze(1), key, value, plan, kernel, self.softmax_scale)
        return out.flatten(1)[:, None]
