"""Qwen3-VL's vision tower in megatron-core terms, under the encoder's own TP group, with DeepStack.

Images arrive at native resolution as transformers' image processor cuts them (Qwen2-VL's, shared with
Qwen2.5-VL: families/qwen2_5_vl/media.py): each image t x h x w patches of C x T x P x P pixels,
flattened, the patches of each merge block adjacent. All of a rank's images run in one call, their
patches back to back ([tokens, 1, hidden]); attention stays within an image (SegmentAttention over
the images' cu_seqlens; no windows). The patch embedding is a linear map of the flattened patch (with
bias) plus a learned position embedding resampled (bilinear, align_corners) from its square grid to
the image's grid; the layers are megatron-core's (LayerNorm, fused QKV with bias, an ungated MLP with
biases) with the 2D rotary embedding of Qwen2.5-VL (half the rotary channels by the patch's row,
half by its column).

DeepStack: after each layer of `deepstack_visual_indexes`, the hidden states go through a merger of
their own (a LayerNorm over each merge block's 4 tokens together, then an MLP); the last layer's
through the main merger (the block's final LayerNorm per token, then an MLP). transformers adds
DeepStack merger k's rows to the output of LLM layer k, at the image's positions.

Output: rows [sum over images of t*h*w/merge^2, llm hidden * (1 + deepstack layers)], image by
image, each image's rows in the order of its placeholder tokens (with context parallelism a rank's
whole merge blocks of each image, attending over the CP group: models/varlen.py); the columns [main rows | DeepStack
rows of LLM layer 0 | of layer 1 | ...]. One row per placeholder carries every edge of the tower:
the boundary plans and moves rows, so every edge is re-laid forward and its gradients routed back
by one exchange (models/vlm.py: `deepstack` takes the extra columns apart on the LLM side).
"""

from dataclasses import dataclass

import torch
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.families.qwen2_5_vl.vision import QwenPatchArch, tower_configs, vision_layer_spec
from megatron_hetero.models.specs import block_spec
from megatron_hetero.models.varlen import CPSplit, SegmentParams


@dataclass(frozen=True)
class Qwen3VisionArch(QwenPatchArch):
    """ModelSizes.family_arch of Qwen3-VL: the vision config fields beyond the enc_* sizes."""

    patch_size: int = 16
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @property
    def grid_side(self) -> int:
        """The learned position embedding's square grid."""
        return int(self.num_position_embeddings**0.5)


def grid_layout(grids: torch.Tensor, arch: Qwen3VisionArch, device="cpu", cp_group=None):
    """(the patches the layers run [tokens] (None: all), their (h, w) positions [tokens, 2],
    position-embedding indices and weights [tokens, 4], the images' SegmentParams) of packed images
    with patch grids `grids` [n, 3] (host), on `device` in one copy: transformers' own functions, so
    the layout is the one its model uses; with a CP group of more than one rank, this rank's whole
    merge blocks of each image (models/varlen.py: CPSplit)."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    grids, merge = grids.cpu(), arch.spatial_merge_size
    indices, weights = get_vision_interpolation_indices_and_weights(
        grids, num_grid_per_side=arch.grid_side, mode="bilinear", align_corners=True, spatial_merge_size=merge)
    per_token = [get_vision_position_ids(grids, merge), indices, weights]
    split = None
    if cp_group is not None and cp_group.size() > 1:
        split = CPSplit.of(grids.prod(1) // arch.merge_unit, None, arch.merge_unit, cp_group)
        tokens = split.tokens(arch.merge_unit)
        per_token = [tokens, *(t[tokens] for t in per_token)]
    params, moved = SegmentParams.of(get_vision_cu_seqlens(grids), device=device, extra=per_token, split=split)
    return (*([None] if split is None else []), *moved, params)


class DeepStackMerger(MegatronModule):
    """A DeepStack merger: LayerNorm over a merge block's tokens together, then the MLP projector."""

    def __init__(self, projector_config: TransformerConfig, merged: int, eps: float,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config=projector_config)
        # Replicated over TP: its input (every token, whole) and output gradient are the same on every rank.
        self.norm = torch.nn.LayerNorm(merged, eps=eps, dtype=projector_config.params_dtype)
        self.projector = MultimodalProjector(
            projector_config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp", input_size=merged, pg_collection=pg_collection)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.projector(self.norm(blocks))


class DeepStackMergers(MegatronModule):
    """The DeepStack mergers, children "0", "1", ...: a MegatronModule (not a ModuleList) so that
    checkpoints store their TP-split projectors as such (megatron-core's sharded_state_dict)."""

    def __init__(self, projector_config: TransformerConfig, mergers: list[DeepStackMerger]):
        super().__init__(config=projector_config)
        for k, merger in enumerate(mergers):
            self.add_module(str(k), merger)


class Qwen3VisionEncoder(MegatronModule):
    """patches [tokens, C*T*P*P] of images with grids [n, 3] -> rows [tokens / merge^2,
    llm hidden * (1 + DeepStack layers)] (module docstring)."""

    share_embeddings_and_output_weights = False

    def __init__(self, config: TransformerConfig, projector_config: TransformerConfig, arch: Qwen3VisionArch,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config=config)
        self.arch = arch
        self.cp_group = pg_collection.cp  # its ranks split each image (models/varlen.py: CPSplit)
        hidden, dtype = config.hidden_size, config.params_dtype
        # Replicated over the encoder's TP group (small; its input is the raw patch): transformers'
        # Conv3d with stride = kernel as one linear map of the flattened patch.
        self.input_embedding = torch.nn.Linear(arch.patch_dim, hidden, bias=True, dtype=dtype)
        self.position_embedding = torch.nn.Embedding(arch.num_position_embeddings, hidden, dtype=dtype)
        self.decoder = TransformerBlock(config=config, spec=block_spec(vision_layer_spec(pg_collection, None), config,
                                                                        pg_collection, te=False),
                                        pre_process=True, post_process=True, pg_collection=pg_collection)
        merged = hidden * arch.merge_unit
        self.projector = MultimodalProjector(
            projector_config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp", input_size=merged, pg_collection=pg_collection)
        self.deepstack = DeepStackMergers(projector_config, [
            DeepStackMerger(projector_config, merged, config.layernorm_epsilon, pg_collection)
            for _ in arch.deepstack_visual_indexes])
        spatial = config.kv_channels // 2  # rotary channels per axis pair: head_dim / 4 frequencies each
        self.register_buffer("inv_freq", 1.0 / arch.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float)
                                                                    / spatial), persistent=False)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, 1, h] -> [merge blocks, 1, merge unit * h] (a merge block's tokens are adjacent)."""
        return x.unflatten(0, (-1, self.arch.merge_unit)).transpose(1, 2).flatten(2)

    def _embed(self, patches: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x = self.input_embedding(patches)
        table = self.position_embedding(indices)  # [tokens, 4, h]
        return x + (table * weights.to(table.dtype)[..., None]).sum(1)

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        tokens, positions, indices, weights, params = grid_layout(grids, self.arch, patches.device, self.cp_group)
        patches = patches if tokens is None else patches.index_select(0, tokens)
        x = self._embed(patches, indices, weights)[:, None]
        angles = positions[..., None].float() * self.inv_freq  # [tokens, 2, head_dim / 4]
        rotary = torch.cat([angles.flatten(1)] * 2, -1)[:, None, None]  # [tokens, 1, 1, head_dim]
        deep = dict(zip(self.arch.deepstack_visual_indexes, self.deepstack.children()))
        stacked = []
        for index, layer in enumerate(self.decoder.layers):
            x, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=params)
            if index in deep:
                stacked.append(deep[index](self._blocks(x)))
        rows = self.projector(self._blocks(self.decoder.final_layernorm(x)))
        return torch.cat([rows, *stacked], -1).squeeze(1)


def build_vision_encoder(sizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
                         whole: bool = False, **config_overrides) -> Qwen3VisionEncoder:
    """The vision module on this rank; its DeepStack mergers take the main merger's config (exact GELU)."""
    arch = Qwen3VisionArch.of(sizes)
    config, projector = tower_configs(sizes, tp, pgs, dtype, whole, arch.merge_unit, **config_overrides)
    return Qwen3VisionEncoder(config, projector, arch, pgs)
