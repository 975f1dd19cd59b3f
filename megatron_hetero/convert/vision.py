"""SigLIP and CLIP vision towers onto our vision encoder (models/vision.py) without its projector:
patch convolution (CLIP's without bias), learned positions, pre-norm layers with biases, the
post-layernorm as the block's final norm; CLIP adds a class token and a layernorm before the layers.

Our encoder emits every token after the final norm, not pooled outputs: SigLIP's pooling head (and
any tensor of the file our encoder does not hold) is carried unchanged from import to export
(Family.untrained), and for CLIP the post-layernorm, which Hugging Face applies to the class token's
output alone (pooler_output), normalizes every token. Pixels arrive normalized as the directory's
image processor says (recorded at import: VisionArch.pixel_normalization)."""

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.rules import Flattened, Same, qkv_rules, same_params
from megatron_hetero.data.images import NORMALIZATION
from megatron_hetero.spec.sizes import ACTIVATIONS, ModelSizes

FIELDS = (
    Field("hidden_size", "enc_hidden_size"),
    Field("num_hidden_layers", "enc_num_layers"),
    Field("num_attention_heads", "enc_num_attention_heads"),
    Field("image_size", "image_size"),
    Field("patch_size", "patch_size"),
    Field("intermediate_size", "arch.ffn_hidden_size"),
    Field("layer_norm_eps", "arch.norm_eps"),
    Field("hidden_act", "arch.activation", choices=tuple(ACTIVATIONS)),
)
CHANNELS = 3  # VisionEncoder's in_channels
# Pixel values arrive normalized by the Hugging Face image processor.
ARCH = dict(linear_bias=True, rescale_pixels=False)


def vision_rules(sizes: ModelSizes) -> list:
    arch = sizes.vision_arch
    hidden, heads, patch = sizes.enc_hidden_size, sizes.enc_num_attention_heads, sizes.patch_size
    conv_shape = (hidden, CHANNELS, patch, patch)
    rules = [Flattened("input_embedding.weight", "embeddings.patch_embedding.weight", conv_shape),
             Same("position_embedding", "embeddings.position_embedding.weight"),
             *same_params("decoder.final_layernorm", "post_layernorm")]
    if arch.patch_bias:
        rules.append(Same("input_embedding.bias", "embeddings.patch_embedding.bias"))
    if arch.class_token:
        rules.append(Same("class_embedding", "embeddings.class_embedding"))
    if arch.pre_norm:
        rules += same_params("pre_norm", "pre_layrnorm")
    bias = arch.linear_bias
    for i in range(sizes.enc_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"encoder.layers.{i}."
        rules += qkv_rules(f"{ours}self_attention.linear_qkv", f"{hf}self_attn", heads, heads, bias)
        rules += [*same_params(f"{ours}input_layernorm", f"{hf}layer_norm1"),
                  *same_params(f"{ours}self_attention.linear_proj", f"{hf}self_attn.out_proj", bias),
                  *same_params(f"{ours}pre_mlp_layernorm", f"{hf}layer_norm2"),
                  *same_params(f"{ours}mlp.linear_fc1", f"{hf}mlp.fc1", bias),
                  *same_params(f"{ours}mlp.linear_fc2", f"{hf}mlp.fc2", bias)]
    return rules


_COMMON = dict(module="vision", fields=FIELDS, hf_fixed={"num_channels": CHANNELS}, rules=vision_rules,
               ours_only=("projector.",), hf_prefix="vision_model.")
POSITION_IDS = "embeddings.position_ids"  # a tensor in older files
SIGLIP = Family("siglip", "siglip_vision_model", "SiglipVisionModel", arch=ARCH, hf_kept=("head.", POSITION_IDS),
                hf_export={"vision_use_head": False}, pixels=NORMALIZATION["siglip"], **_COMMON)
CLIP = Family("clip", "clip_vision_model", "CLIPVisionModel",
              arch={**ARCH, "patch_bias": False, "class_token": True, "pre_norm": True},
              hf_kept=(POSITION_IDS,), pixels=NORMALIZATION["clip"], **_COMMON)
