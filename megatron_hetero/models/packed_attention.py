"""megatron-core's SelfAttention for the packed encoders (the Qwen ViTs: every image of a rank in one
[tokens, 1, hidden] call, SegmentAttention within images or windows), the work between its GEMMs fused.

Why: between the QKV GEMM and the core attention megatron-core runs the QKV bias add (one pass over
[tokens, 3 x hidden] inside its linear layer), the split into query, key and value (strided views),
RoPE on the query and on the key (a kernel each) and, where flash-attn-4 runs a head dim zero-padded
to a checked one (attention_kernels.py), a fill and a strided copy per tensor; backward, the query's
and key's RoPE gradients and the split's concatenation of the three gradients (one more copy of
them). After the core attention the padded columns are cut off (a strided copy; backward a fill and
a copy). In Qwen2.5-VL-7B's profiled step on one H200 (SDPA; 32 layers x 4 microbatches) the bias adds
took 32 ms, the concatenation 35 ms and RoPE 27 ms. Here the bias, the split, the rotation and the
padding are one function compiled on GPUs (torch.compile; on an H200 three kernels each way, the QKV
gradient written directly, the bias gradient's reduction among them), and the cut another: together
70 ms of that step with flash-attn-4 at head dim 80 padded to 96 (the A/B: docs/results.md, section 3).
Under MEGATRON_HETERO_ATTENTION_INPUT=triton both run on our Triton kernels instead, one each way at an
eager op's host cost (models/attention_input.py).

The module is SelfAttention (same parameters, names, checkpoints, TP and sequence-parallel layout):
the QKV linear leaves its bias to the fused function (skip_bias_add; the bias gradient is the same
sum), the core attention takes the heads already at the width of the kernel that runs the call's
segments (SegmentAttention.plan: windows and whole items may differ) and returns them so. The same
numbers up to bf16 rounding on GPUs (the fused kernels round once), megatron-core's bit for bit on
CPUs (eager, nothing padded). Where the layer's kernel policy asks for upstream's RoPE
(MEGATRON_HETERO_EAGER_ROPE=1, to compare), megatron-core's forward runs instead.
"""

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention

from megatron_hetero.models import attention_input, kernel_policy
from megatron_hetero.models.rope import cached_cos_sin, rotate


def split_heads(mixed: torch.Tensor, bias: torch.Tensor | None, groups: int, per_group: int,
                head_dim: int) -> tuple[torch.Tensor, ...]:
    """The QKV linear's output plus its bias as query [tokens, groups * per_group, head_dim], key and
    value [tokens, groups, head_dim]: views of megatron-core's layout (packed_heads)."""
    x = mixed if bias is None else mixed + bias
    x = x.view(x.shape[0], groups, per_group + 2, head_dim)
    return x[:, :, :per_group].flatten(1, 2), x[:, :, per_group], x[:, :, per_group + 1]


def packed_heads(mixed: torch.Tensor, bias: torch.Tensor | None, rotary: tuple | None, groups: int,
                 per_group: int, head_dim: int, run_dim: int) -> tuple[torch.Tensor, ...]:
    """The QKV linear's output [tokens, 1, groups * (per_group + 2) * head_dim] (megatron-core's layout:
    each query group's per_group query heads, then its key and its value head) plus its bias ->
    query [tokens, groups * per_group, run_dim], key and value [tokens, groups, run_dim]: query and key
    rotated by rotary ((cos_q, sin_q, cos_k, sin_k), each [tokens, 1, 1, head_dim]; None: no RoPE), all
    three zero-padded from head_dim to run_dim."""
    q, k, v = split_heads(mixed, bias, groups, per_group, head_dim)
    pad = run_dim - head_dim
    if rotary is None:
        return tuple(F.pad(t, (0, pad)) if pad else t for t in (q, k, v))
    cos_q, sin_q, cos_k, sin_k = (t.flatten(1, 2) for t in rotary)  # [tokens, 1, head_dim]
    return rotate(q, cos_q, sin_q, pad), rotate(k, cos_k, sin_k, pad), F.pad(v, (0, pad)) if pad else v


def cut_heads(out: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The core attention's output [tokens, 1, heads * run_dim] cut to [tokens, 1, heads * head_dim]."""
    return out.unflatten(-1, (heads, -1))[..., :head_dim].flatten(-2)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, fullgraph=True)


def torch_heads(mixed: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """packed_heads as the layer runs it off our kernels: compiled on GPUs."""
    return (_compiled(packed_heads) if mixed.is_cuda else packed_heads)(mixed, *args)


def torch_cut(out: torch.Tensor, *args) -> torch.Tensor:
    """cut_heads as the layer runs it off our kernel: compiled on GPUs."""
    return (_compiled(cut_heads) if out.is_cuda else cut_heads)(out, *args)


def fuses_heads(config) -> bool:
    """Whether the packed encoder layers of `config` take the fused path: no query/key norms or output
    gate between the GEMMs (packed_heads has none), RoPE neither interleaved nor Transformer Engine's,
    and the config's kernel policy not asking for upstream's."""
    return not (config.qk_layernorm or config.attention_output_gate or config.rotary_interleaved
                or config.apply_rope_fusion or kernel_policy.of(config).eager_rope)


class PackedSelfAttention(SelfAttention):
    """SelfAttention whose core attention is SegmentAttention (models/varlen.py), the QKV bias, split,
    RoPE and padding fused (module docstring); megatron-core's forward where fuses_heads says not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = fuses_heads(self.config)
        self.on_triton = kernel_policy.of(self.config).attention_input == "triton"  # attention_input.py
        if self.fused:
            self.linear_qkv.skip_bias_add = True  # packed_heads adds it

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        if not self.fused:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias,
                                   packed_seq_params, sequence_len_offset, inference_params=inference_params)
        if inference_context is not None or inference_params is not None or key_value_states is not None:
            raise ValueError("PackedSelfAttention runs packed encoder training and evaluation, not inference")
        mixed, bias = self.linear_qkv(hidden_states)
        head_dim = self.hidden_size_per_attention_head
        rotary = None
        if rotary_pos_emb is not None:
            tables = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            if any(t.shape[-1] != head_dim for t in tables):
                raise ValueError("PackedSelfAttention rotates whole heads: rotary tables of the head dim")
            rotary = tuple(t for table in tables for t in cached_cos_sin(table, self._yarn_concentration_factor,
                                                                            mixed.dtype))
        groups = self.num_query_groups_per_partition
        run_dim = self.core_attention.plan(packed_seq_params)[1].run_head_dim  # the kernel of this call's segments
        shape = (groups, self.num_attention_heads_per_partition // groups, head_dim, run_dim)
        if self.on_triton and attention_input.takes(mixed, bias, rotary, head_dim):
            heads = attention_input.packed_heads
        else:
            heads = torch_heads
        q, k, v = (t[:, None] for t in heads(mixed, bias, rotary, *shape))
        if self.checkpoint_core_attention and self.training:
            out = self._checkpointed_attention_forward(q, k, v, attention_mask, packed_seq_params=packed_seq_params)
        else:
            out = self.core_attention(q, k, v, attention_mask, packed_seq_params=packed_seq_params)
        if run_dim > head_dim:
            if self.on_triton and attention_input.cuts(out):
                cut = attention_input.cut_heads
            else:
                cut = torch_cut
            out = cut(out, self.num_attention_heads_per_partition, head_dim)
        return self.linear_proj(out)
