"""Qwen2.5-VL's vision tower in megatron-core terms, under the encoder's own TP group.

Images arrive at native resolution as the image processor cuts them (media.py): each image a grid of
t x h x w patches of C x T x P x P pixels, flattened, the patches of 2x2 merge blocks adjacent. All of
a rank's images run in one call, their patches back to back ([tokens, 1, hidden] through a
TransformerBlock); attention stays within an image (SegmentAttention over the images' cu_seqlens) and,
in every layer but the full-attention ones (`fullatt_block_indexes`), within a window of
window_size pixels: the patches are permuted window by window before the layers (transformers'
window index, per merge block) and the merged rows permuted back after. The layers are megatron-core's
(RMSNorm, fused QKV with bias, SwiGLU MLP with biases) with a 2D rotary embedding (half the rotary
channels rotate by the patch's row, half by its column). The patch merger is the block's final
RMSNorm (transformers' `ln_q`) and an MLP projector over each merge block's 4 tokens into the LLM's
hidden size (ColumnParallel -> GELU -> RowParallel).

Output: rows [sum over images of t*h*w/merge^2, llm hidden], image by image, each image's rows in
its merged grid's row-major order: the order of its placeholder tokens in the LLM sequence. With
context parallelism a rank runs whole merge blocks of each image, windows cut between ranks, and
attends over the CP group (models/varlen.py): its rows are its blocks', in that order.
"""

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.packed_attention import PackedSelfAttention
from megatron_hetero.models.specs import block_spec, with_our_layers
from megatron_hetero.models.varlen import CPSplit, SegmentAttention, SegmentParams, permute


@dataclass(frozen=True)
class QwenPatchArch:
    """The patch geometry Qwen's native-resolution ViTs share (Qwen2.5-VL's here, Qwen3-VL's in
    qwen3_vl/vision.py): C x T x P x P pixel values per patch, S x S patches merged into one row."""

    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch (C x T x P x P)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @classmethod
    def of(cls, sizes):
        """The arch ModelSizes.family_arch records (its lists read as the tuple fields they are; a
        tuple field it lacks is empty; values of the family's other modules left out)."""
        names = {f.name for f in fields(cls)}
        values = {key: value for key, value in sizes.family_arch.items() if key in names}
        values.update({f.name: tuple(values.get(f.name, ())) for f in fields(cls) if isinstance(f.default, tuple)})
        return cls(**values)


@dataclass(frozen=True)
class QwenVisionArch(QwenPatchArch):
    """ModelSizes.family_arch of Qwen2.5-VL: the vision config fields beyond the enc_* sizes."""

    window_size: int = 112  # pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0


def vision_layer_spec(pg_collection: ProcessGroupCollection, full_layers: frozenset) -> ModuleSpec:
    """megatron-core's ViT layer on our norms, its core attention within items / windows, the work
    between its attention GEMMs fused (PackedSelfAttention)."""
    layer = with_our_layers(get_vit_layer_with_local_spec(), pg_collection)
    layer.submodules.self_attention.module = PackedSelfAttention
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SegmentAttention, params={"full_layers": full_layers})
    return layer


class GridLayout(NamedTuple):
    """A forward's packed images, planned once on the host from their grids and on the device in one
    copy (models/varlen.py): `tokens` the patches the layers run (long [tokens]: this CP rank's, in
    window order), `positions` each one's patch (h, w) [tokens, 2], `unblocks` / `blocks` the merged
    rows' permutation out of window order into the input's and back (long [tokens / merge unit]),
    `segments` the images' and the windows' attention plans."""

    tokens: torch.Tensor
    positions: torch.Tensor
    unblocks: torch.Tensor
    blocks: torch.Tensor
    segments: SegmentParams


def inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))


def grid_layout(grids: torch.Tensor, arch: QwenVisionArch, device="cpu", cp_group=None) -> GridLayout:
    """The GridLayout of packed images with patch grids `grids` [n, 3] (host): transformers' own
    functions, so that the layout is the one its model uses; with a CP group of more than one rank,
    this rank's whole merge blocks of each image (CPSplit)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    grids = grids.cpu()
    unit = arch.merge_unit
    blocks, windows = get_vision_window_index(grids, arch.spatial_merge_size, arch.window_size, arch.patch_size)
    split = None
    if cp_group is not None and cp_group.size() > 1:
        split = CPSplit.of(grids.prod(1) // unit, blocks, unit, cp_group)
        blocks = split.blocks
    tokens = (blocks[:, None] * unit + torch.arange(unit)).flatten()
    positions = get_vision_position_ids(grids, arch.spatial_merge_size)[tokens]
    # The rows out of window order: the held blocks in the input's order
    unblocks = inverse(blocks) if split is None else torch.argsort(blocks)
    segments, moved = SegmentParams.of(get_vision_cu_seqlens(grids), windows, device,
                                       [tokens, positions, unblocks, inverse(unblocks)], split)
    return GridLayout(*moved, segments)


class QwenVisionEncoder(MegatronModule):
    """patches [tokens, C*T*P*P] of images with grids [n, 3] -> rows [tokens / merge^2, llm hidden]."""

    share_embeddings_and_output_weights = False

    def __init__(self, config: TransformerConfig, projector_config: TransformerConfig, arch: QwenVisionArch,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config=config)
        self.arch = arch
        self.cp_group = pg_collection.cp  # its ranks split each image (models/varlen.py: CPSplit)
        hidden = config.hidden_size
        # Replicated over the encoder's TP group (small; its input is the raw patch): transformers'
        # Conv3d with stride = kernel as one linear map of the flattened patch.
        self.input_embedding = torch.nn.Linear(arch.patch_dim, hidden, bias=False, dtype=config.params_dtype)
        full = frozenset(arch.fullatt_block_indexes)
        self.decoder = TransformerBlock(config=config, spec=block_spec(vision_layer_spec(pg_collection, full), config,
                                                                        pg_collection, te=False),
                                        pre_process=True, post_process=True, pg_collection=pg_collection)
        self.projector = MultimodalProjector(
            projector_config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp", input_size=hidden * arch.merge_unit, pg_collection=pg_collection)
        head_dim = config.kv_channels
        spatial = head_dim // 2  # rotary channels per axis pair: head_dim / 4 frequencies each for h and w
        self.register_buffer("inv_freq", 1.0 / arch.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float)
                                                                    / spatial), persistent=False)

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        layout = grid_layout(grids, self.arch, patches.device, self.cp_group)
        x = self.input_embedding(patches.index_select(0, layout.tokens))  # window order
        angles = layout.positions[..., None].float() * self.inv_freq  # [tokens, 2, head_dim / 4], window order
        rotary = torch.cat([angles.flatten(1)] * 2, -1)[:, None, None]  # [tokens, 1, 1, head_dim]
        x = self.decoder(x[:, None], attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=layout.segments)
        # A merge block's tokens are adjacent: [tokens, 1, h] -> [blocks, 1, merge unit * h]
        rows = self.projector(x.unflatten(0, (-1, self.arch.merge_unit)).transpose(1, 2).flatten(2))
        return permute(rows.squeeze(1), layout.unblocks, layout.blocks)


def tower_configs(sizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype, whole: bool, merge_unit: int,
                  **config_overrides) -> tuple[TransformerConfig, TransformerConfig]:
    """The layers' config and the merger's of a Qwen ViT on this rank (Qwen2.5-VL's and Qwen3-VL's):
    one pipeline stage, the tower is not split over stages."""
    from megatron_hetero.models.vlm import transformer_config

    if not whole and pgs.pp.size() > 1:
        raise ValueError(f"the {sizes.family} vision tower runs as one pipeline stage; set the vision module's pp: 1")
    hidden = sizes.enc_hidden_size
    config = transformer_config(hidden, sizes.enc_num_layers, sizes.enc_num_attention_heads, tp, dtype,
                                arch=sizes.vision_arch, **config_overrides)
    merged = hidden * merge_unit  # the merger's MLP: merged -> merged -> LLM hidden, GELU, biases
    projector = transformer_config(sizes.hidden_size, 1, sizes.num_attention_heads, tp, dtype, ffn_hidden_size=merged,
                                   add_bias_linear=True, **config_overrides)
    return config, projector


def build_vision_encoder(sizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
                         whole: bool = False, **config_overrides) -> QwenVisionEncoder:
    """The vision module on this rank."""
    arch = QwenVisionArch.of(sizes)
    config, projector = tower_configs(sizes, tp, pgs, dtype, whole, arch.merge_unit, **config_overrides)
    return QwenVisionEncoder(config, projector, arch, pgs)
