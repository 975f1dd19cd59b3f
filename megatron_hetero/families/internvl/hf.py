"""InternVL's Hugging Face config and weights onto our modules: InternViT with pixel shuffle and the
MLP projector (vision.py) and the LLM (our GPTModel) of its text config: Qwen2, Qwen3 or Llama, mapped
by that LLM's own family (convert/llm.py).

Three spellings of the weights: transformers 5's in memory (`model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`); its files (save_pretrained,
and the Hub's OpenGVLab/*-hf repos: `vision_tower.*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*`); and OpenGVLab's original repos
(`vision_model.*` with InternViT's own names and one fused `attn.qkv` per layer, `mlp1.{0,1,3}` for
the projector, the LLM as in the -hf files). The vision rules are written once over a table of names
per spelling (NAMES); import detects the spelling, export writes it back.
"""

from dataclasses import replace

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.llm import LLAMA, QWEN2, QWEN3, llm_rules
from megatron_hetero.convert.rules import (
    ConcatQKV,
    Flattened,
    HFMappingError,
    Reshaped,
    Same,
    qkv_rules,
    same_params,
    with_hf_names,
)
from megatron_hetero.families.base import KeyScheme
from megatron_hetero.spec.sizes import ACTIVATIONS, ModelSizes

VISION, PROJECTOR, TEXT = "model.vision_tower.", "model.multi_modal_projector.", "model.language_model."
# The LLM families an InternVL's text_config may be (its model_type).
TEXT_FAMILIES = {family.model_type: family for family in (QWEN2, QWEN3, LLAMA)}

_V = "vision_config."
VISION_FIELDS = (
    Field(f"{_V}hidden_size", "enc_hidden_size"),
    Field(f"{_V}num_hidden_layers", "enc_num_layers"),
    Field(f"{_V}num_attention_heads", "enc_num_attention_heads"),
    Field(f"{_V}intermediate_size", "arch.ffn_hidden_size"),
    Field(f"{_V}hidden_act", "arch.activation", choices=tuple(ACTIVATIONS)),
    Field(f"{_V}layer_norm_eps", "arch.norm_eps"),
    Field(f"{_V}attention_bias", "family.qkv_bias"),
    Field(f"{_V}use_qk_norm", "family.qk_norm"),
    Field(f"{_V}layer_scale_init_value", "family.layer_scale_init"),
    Field(f"{_V}norm_type", "family.norm_type", choices=("layer_norm", "rms_norm")),
    Field("downsample_ratio", "family.downsample_ratio"),
    Field("projector_hidden_act", "family.projector_activation", choices=tuple(ACTIVATIONS)),
)
# What the mapping assumes: every published InternVL has these (the original InternViT has no norm
# after its last layer: transformers' mean pooling; the class token is dropped before the projector).
VISION_FIXED = {f"{_V}use_mean_pooling": True, f"{_V}use_absolute_position_embeddings": True,
                f"{_V}use_mask_token": False, f"{_V}num_channels": 3, "vision_feature_layer": -1,
                "vision_feature_select_strategy": "default"}
# Linear and patch biases always (only q/k/v's follow attention_bias); pixels arrive normalized.
VISION_ARCH = dict(linear_bias=True, patch_bias=True, class_token=True, rescale_pixels=False)

# Per spelling: where each tensor of the vision module lives ({i}: the layer).
NAMES = {
    "transformers": dict(
        cls=f"{VISION}embeddings.cls_token", pos=f"{VISION}embeddings.position_embeddings",
        patch=f"{VISION}embeddings.patch_embeddings.projection", layer=f"{VISION}encoder.layer.{{i}}.",
        qkv=None, attn="attention", proj="attention.projection_layer", scale=("lambda_1", "lambda_2"),
        norms=("layernorm_before", "layernorm_after"), projector=(f"{PROJECTOR}layer_norm", f"{PROJECTOR}linear_1",
                                                                   f"{PROJECTOR}linear_2")),
    "opengvlab": dict(
        cls="vision_model.embeddings.class_embedding", pos="vision_model.embeddings.position_embedding",
        patch="vision_model.embeddings.patch_embedding", layer="vision_model.encoder.layers.{i}.",
        qkv="attn.qkv", attn="attn", proj="attn.proj", scale=("ls1", "ls2"), norms=("norm1", "norm2"),
        projector=("mlp1.0", "mlp1.1", "mlp1.3")),
}
# The LLM in files (both file spellings): transformers' save_pretrained undoes its load-time renames.
FILE_TEXT = (("lm_head.", "language_model.lm_head."), (TEXT, "language_model.model."))
HF_FILES = KeyScheme("hf_files", (*FILE_TEXT, (VISION, "vision_tower."), (PROJECTOR, "multi_modal_projector.")))


def vision_rules(sizes: ModelSizes, spelling: str = "transformers") -> list:
    """Our vision module (InternViT + projector) from the Hugging Face tensors named as `spelling` does."""
    from megatron_hetero.families.internvl.vision import CHANNELS, InternVLVisionArch

    arch, names = InternVLVisionArch.of(sizes), NAMES[spelling]
    hidden, heads, p = sizes.enc_hidden_size, sizes.enc_num_attention_heads, sizes.patch_size
    tokens = 1 + sizes.patches_per_image
    norm_bias = sizes.vision_arch.normalization == "LayerNorm"
    rules = [Reshaped("class_embedding", names["cls"], (1, 1, hidden), (hidden,)),
             Reshaped("position_embedding", names["pos"], (1, tokens, hidden), (tokens, hidden)),
             Flattened("input_embedding.weight", f"{names['patch']}.weight", (hidden, CHANNELS, p, p)),
             Same("input_embedding.bias", f"{names['patch']}.bias")]
    for i in range(sizes.enc_num_layers):
        ours, hf = f"decoder.layers.{i}.", names["layer"].format(i=i)
        qkv = f"{ours}self_attention.linear_qkv"
        if names["qkv"] is None:
            rules += qkv_rules(qkv, f"{hf}{names['attn']}", heads, heads, arch.qkv_bias)
        else:
            rules += [ConcatQKV(f"{qkv}.{x}", f"{hf}{names['qkv']}.{x}", heads)
                      for x in ("weight", "bias")[: 1 + arch.qkv_bias]]
        if arch.qk_norm:
            rules += [Same(f"{ours}self_attention.{x}_norm.weight", f"{hf}{names['attn']}.{x}_norm.weight")
                      for x in "qk"]
        rules += [*same_params(f"{ours}self_attention.linear_proj", f"{hf}{names['proj']}"),
                  *(Same(f"{ours}layer_scale_{j + 1}", f"{hf}{name}") for j, name in enumerate(names["scale"])),
                  *same_params(f"{ours}input_layernorm", f"{hf}{names['norms'][0]}", norm_bias),
                  *same_params(f"{ours}pre_mlp_layernorm", f"{hf}{names['norms'][1]}", norm_bias),
                  *same_params(f"{ours}mlp.linear_fc1", f"{hf}mlp.fc1"),
                  *same_params(f"{ours}mlp.linear_fc2", f"{hf}mlp.fc2")]
    norm, fc1, fc2 = names["projector"]
    return rules + [*same_params("projector.layer_norm", norm), *same_params("projector.encoder.linear_fc1", fc1),
                    *same_params("projector.encoder.linear_fc2", fc2)]


def text_rules(sizes: ModelSizes) -> list:
    return llm_rules(sizes, prefix=TEXT)


def opengvlab_rules(sizes: ModelSizes) -> dict[str, list]:
    """module -> rules in OpenGVLab's original names: the vision module's own, the LLM's renamed."""
    return {"vision": vision_rules(sizes, "opengvlab"), "llm": with_hf_names(text_rules(sizes), OPENGVLAB.to_file)}


OPENGVLAB = KeyScheme("opengvlab", FILE_TEXT, rules=opengvlab_rules)

VISION_PART = Family("internvl.vision", "internvl", "InternVLForConditionalGeneration", "vision", VISION_FIELDS,
                     hf_fixed=VISION_FIXED, arch=VISION_ARCH, rules=vision_rules)
# The LLM's sizes come from its own family in `finish` (text_config's model_type decides which).
TEXT_PART = Family("internvl.text", "internvl", "InternVLForConditionalGeneration", "llm", (), hf_fixed={},
                   arch={}, rules=text_rules)


def _square(config, name: str) -> int:
    value = getattr(config.vision_config, name)
    side = value if isinstance(value, int) else value[0]
    if not isinstance(value, int) and any(v != side for v in value):
        raise HFMappingError(f"internvl: vision_config.{name} {list(value)} is not square; only square tiles map")
    return side


def finish(sizes: ModelSizes, config) -> ModelSizes:
    """Tile and patch sizes, the norm type, the pixel shuffle, and the LLM from its own family
    (tied to the embedding as the top-level tie_word_embeddings says: transformers ties there)."""
    from megatron_hetero.families.internvl.vision import InternVLVisionArch

    arch = InternVLVisionArch.of(sizes)
    factor = arch.pixel_shuffle
    image, patch = _square(config, "image_size"), _square(config, "patch_size")
    if abs(arch.downsample_ratio * factor - 1) > 1e-9 or (image // patch) % factor:
        raise HFMappingError(f"internvl: downsample_ratio {arch.downsample_ratio} is not 1/k for a k dividing the "
                             f"{image // patch} patches a side; only such pixel shuffles map")
    normalization = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}[arch.norm_type]
    sizes = replace(sizes, image_size=image, patch_size=patch,
                    vision_arch=replace(sizes.vision_arch, normalization=normalization))
    text_type = config.text_config.model_type
    if text_type not in TEXT_FAMILIES:
        raise HFMappingError(f"internvl: text_config.model_type {text_type!r} is not supported; use one of "
                             f"{', '.join(TEXT_FAMILIES)}")
    sizes = TEXT_FAMILIES[text_type].sizes(config.text_config, sizes)
    return replace(sizes, llm_arch=replace(sizes.llm_arch, tied_embeddings=bool(config.tie_word_embeddings)))


def copies(sizes: ModelSizes) -> dict[str, str]:
    """A tied output layer is the embedding again (in transformers' state_dict; in some files)."""
    return {"lm_head.weight": f"{TEXT}embed_tokens.weight"} if sizes.llm_arch.tied_embeddings else {}
