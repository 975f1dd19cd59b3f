"""InternVL's vision module: InternViT (transformers' InternVLVisionModel) with pixel shuffle and
InternVL's MLP projector, as a pipeline-stage encoder (models/encoder.py) in its own TP group.

InternViT is a ViT with a class token, learned positions and pre-norm layers (LayerNorm, or RMSNorm
for InternViT-6B), whose layers differ from megatron-core's in three ways, each a small module here:
- layer scale: each sublayer's output (bias included) is multiplied by a learned per-channel vector
  before the residual add (transformers' lambda_1, lambda_2; the original's ls1, ls2);
- the query, key and value projections have biases of their own (`attention_bias`), independent of
  the output projection's and the MLP's, which always have them;
- optional QK-norm (InternViT-6B): one RMSNorm over the queries (and one over the keys) of all heads
  together, not per head. Under TP each rank holds some heads, so the sum of squares is summed over
  the TP group (forward and backward: an all-reduce each way); its weight is split with the heads.
Its tokens after the last layer (no final norm with mean pooling, transformers' default) lose the
class token, and each 2x2 block of patch tokens (pixel shuffle, downsample ratio 0.5) becomes one
row four times as wide, which the projector (LayerNorm, Linear, GELU, Linear) maps to the LLM width:
a 448-pixel tile of 14-pixel patches sends 256 rows into the LLM.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from megatron.core.jit import jit_fuser
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from megatron_hetero.models import residual_add
from megatron_hetero.models.encoder import StageEncoder
from megatron_hetero.models.norm import SequenceParallelNorm
from megatron_hetero.models.specs import block_spec, with_our_layers
from megatron_hetero.models.vision import PatchEmbedding
from megatron_hetero.spec.sizes import ModelSizes, TransformerArch

# transformers' InternVLVisionRMSNorm for q_norm/k_norm is built without the config's eps.
QK_NORM_EPS = 1e-6
# nn.LayerNorm's default, which transformers' InternVLMultiModalProjector keeps.
PROJECTOR_NORM_EPS = 1e-5
CHANNELS = 3


@dataclass(frozen=True)
class InternVLVisionArch:
    """ModelSizes.family_arch of InternVL: its vision settings beyond the enc_* sizes and VisionArch
    (transformers' InternVLVisionConfig and InternVLConfig names in comments)."""

    qkv_bias: bool = True  # attention_bias
    qk_norm: bool = False  # use_qk_norm
    layer_scale_init: float = 0.1  # layer_scale_init_value
    mean_pooling: bool = True  # use_mean_pooling: no norm after the last layer
    norm_type: str = "layer_norm"  # or "rms_norm"
    downsample_ratio: float = 0.5  # pixel shuffle: 1 / ratio patches a side become one row
    projector_activation: str = "gelu"  # projector_hidden_act

    @staticmethod
    def of(sizes: ModelSizes) -> "InternVLVisionArch":
        return InternVLVisionArch(**sizes.family_arch)

    @property
    def pixel_shuffle(self) -> int:
        return round(1 / self.downsample_ratio)


def all_reduce_both_ways(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-reduce (sum) over `group`; backward: all-reduce (sum) of the gradients. For a
    value every rank computes from every rank's part and then uses on its own part."""
    return copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(x, group), group)


class SplitHeadsRMSNorm(MegatronModule):
    """RMSNorm over the last two dims [..., heads, head_dim] of all heads together, whose heads are
    split over `tp_group`: this rank's weight is its heads' slice of the whole [heads * head_dim]."""

    def __init__(self, config: TransformerConfig, local_width: int, tp_group, eps: float = QK_NORM_EPS):
        super().__init__(config=config)
        self.tp_group, self.eps = tp_group, eps
        self.width = local_width * tp_group.size()
        self.weight = torch.nn.Parameter(torch.ones(local_width, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_group.size() > 1:
            squares = all_reduce_both_ways(squares, self.tp_group)
        normed = flat * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normed.to(x.dtype)).view_as(x)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight split over TP along its only dim (as a column-parallel bias), replicated over DP."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


class InternViTAttention(SelfAttention):
    """megatron-core's SelfAttention with InternViT's query/key/value biases (`qkv_bias`, apart from
    the output projection's) and its optional QK-norm over all heads (`qk_norm`)."""

    def __init__(self, *args, qkv_bias: bool = True, qk_norm: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if not qkv_bias:  # built with config.add_bias_linear's bias (zeros): none instead
            self.linear_qkv.register_parameter("bias", None)
        self.q_norm = self.k_norm = None
        if qk_norm:
            width = self.query_projection_size // self.world_size
            self.q_norm, self.k_norm = (SplitHeadsRMSNorm(self.config, width, self.pg_collection.tp) for _ in "qk")

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        assert not output_gate and split_qkv, "InternViT's attention has no output gate"
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        return query, key, value


def _scaled_bias_dropout_add_func(x, bias, residual, scale, prob: float, training: bool):
    """residual + dropout(x + bias) * scale."""
    x = x if bias is None else x + bias
    return residual + F.dropout(x, p=prob, training=training) * scale


# As megatron-core's fused bias-dropout-add (its jit_fuser: torch.compile): one kernel each way for
# the bias, layer scale and residual, which eager ran as three passes forward and four backward.
_scaled_bias_dropout_add_fused = jit_fuser(_scaled_bias_dropout_add_func)


def _scaled_bias_dropout_add(scale: torch.nn.Parameter):
    """megatron's bias-dropout-add (a builder taking training, fused: --bias-dropout-fusion) with layer
    scale: residual + dropout(x + bias) * scale; fused, on our Triton kernel where the residual-add
    mode runs it there (models/residual_add.py)."""

    def build(training: bool, fused: bool):
        func = _scaled_bias_dropout_add_fused if fused else _scaled_bias_dropout_add_func
        mode = residual_add.mode() if fused else "torch"

        def bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if residual_add.kernel_adds(mode, training, prob, x, bias, residual, scale):
                return residual_add.residual_add(x, bias, residual, scale)
            return func(x, bias, residual, scale, prob, training)
        return bias_dropout_add
    return build


class LayerScaleTransformerLayer(TransformerLayer):
    """A TransformerLayer whose attention and MLP outputs are scaled per channel before the residual
    add (InternViT's layer scale); `layer_scale_init`: the scales' initial value."""

    def __init__(self, *args, layer_scale_init: float = 0.1, **kwargs):
        super().__init__(*args, **kwargs)
        hidden, dtype = self.config.hidden_size, self.config.params_dtype
        self.layer_scale_1 = torch.nn.Parameter(torch.full((hidden,), layer_scale_init, dtype=dtype))
        self.layer_scale_2 = torch.nn.Parameter(torch.full((hidden,), layer_scale_init, dtype=dtype))
        self.self_attn_bda = _scaled_bias_dropout_add(self.layer_scale_1)
        self.mlp_bda = _scaled_bias_dropout_add(self.layer_scale_2)


def internvit_layer_spec(pg_collection: ProcessGroupCollection, arch: InternVLVisionArch):
    """InternViT's layer: megatron-core's local ViT layer with our attention and norms (models/specs.py),
    layer scale, and InternViT's attention. Our layers also where Transformer Engine imports (TE's
    fuse the input norm into the qkv projection, which the layer-scale and bias changes don't fit)."""
    layer = with_our_layers(get_vit_layer_with_local_spec(), pg_collection)
    layer.module = LayerScaleTransformerLayer
    layer.params = {**layer.params, "layer_scale_init": arch.layer_scale_init}
    attention = layer.submodules.self_attention
    attention.module = InternViTAttention
    attention.params = {**attention.params, "qkv_bias": arch.qkv_bias, "qk_norm": arch.qk_norm}
    return layer


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """[side * side, n, h] patch tokens (row-major) -> [(side / f)^2, n, f^2 * h]: each f x f block
    becomes one token, its channels ordered (block row, block column, h) as transformers'
    InternVLModel.pixel_shuffle orders them."""
    side = round(x.shape[0] ** 0.5)
    return rearrange(x, "(i a j b) n h -> (i j) n (a b h)", i=side // factor, a=factor, b=factor)


class InternVLProjector(MultimodalProjector):
    """Pixel shuffle, a LayerNorm, then Megatron's MLP projector (fc1 column-parallel, fc2
    row-parallel): [tokens, n, hidden] -> [tokens / factor^2, n, llm_hidden]."""

    def __init__(self, config: TransformerConfig, hidden: int, factor: int, pg_collection: ProcessGroupCollection):
        width = hidden * factor**2
        super().__init__(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                         projector_type="mlp", input_size=width, pg_collection=pg_collection)
        self.factor = factor
        self.layer_norm = SequenceParallelNorm(config, width, PROJECTOR_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.layer_norm(pixel_shuffle(x, self.factor)))


class InternViTEncoder(StageEncoder):
    """images (448-pixel tiles) [n, C, H, W] -> rows [n * rows_per_image, llm_hidden] on the last stage."""

    def __init__(self, config: TransformerConfig, projector_config: TransformerConfig, image_size: int,
                 patch_size: int, pg_collection: ProcessGroupCollection, pre_process: bool = True,
                 post_process: bool = True, arch: InternVLVisionArch = InternVLVisionArch()):
        side, factor = image_size // patch_size, arch.pixel_shuffle
        if image_size % patch_size or side % factor:
            raise ValueError(f"image size {image_size} is not a multiple of patch size {patch_size} x pixel "
                             f"shuffle {factor}")
        super().__init__(
            config, projector_config, side**2, pg_collection,
            lambda: PatchEmbedding(CHANNELS, patch_size, config.hidden_size, rescale=False),
            pre_process, post_process, class_token=True,
            block=block_spec(internvit_layer_spec(pg_collection, arch), config, pg_collection, te=False),
            final_norm=not arch.mean_pooling,
            projector=partial(InternVLProjector, projector_config, config.hidden_size, factor, pg_collection),
        )


def build_vision_encoder(sizes: ModelSizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
                         whole: bool = False, **config_overrides) -> InternViTEncoder:
    """This rank's stage of InternVL's vision module (models/vlm.py's encoder builders): InternViT
    from sizes.vision_arch and family_arch, its projector of the LLM's width with biases."""
    from megatron_hetero.models.vlm import build_encoder

    arch = InternVLVisionArch.of(sizes)
    dims = (sizes.enc_hidden_size, sizes.enc_num_layers, sizes.enc_num_attention_heads)
    projector = TransformerArch(ffn_hidden_size=sizes.hidden_size, linear_bias=True,
                                activation=arch.projector_activation)
    return build_encoder(InternViTEncoder, dims, (sizes.image_size, sizes.patch_size), sizes, tp, pgs, dtype,
                         whole, sizes.vision_arch, config_overrides=config_overrides, projector_arch=projector,
                         arch=arch)
