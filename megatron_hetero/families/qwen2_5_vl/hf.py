"""Qwen2.5-VL's Hugging Face config and weights onto our modules: the vision tower (vision.py) and
a Qwen2 LLM with M-RoPE (our GPTModel). Weight rules are in transformers 5's in-memory names
(`model.visual.*`, `model.language_model.*`, `lm_head.*`); the Hub's files spell them `visual.*`,
`model.*` (HUB below)."""

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.llm import ROPE, llm_fields, llm_rules
from megatron_hetero.convert.rules import ConcatQKV, Flattened, HFMappingError, Same, Stacked, same_params
from megatron_hetero.families.base import KeyScheme
from megatron_hetero.spec.sizes import ACTIVATIONS, ModelSizes

VISION, TEXT = "model.visual.", "model.language_model."
HUB = KeyScheme("hub", ((VISION, "visual."), (TEXT, "model.")))

_V = "vision_config."
# The vision config fields Qwen's native-resolution ViTs share (Qwen3-VL's: qwen3_vl/hf.py).
QWEN_VISION_FIELDS = (
    Field(f"{_V}hidden_size", "enc_hidden_size"),
    Field(f"{_V}depth", "enc_num_layers"),
    Field(f"{_V}num_heads", "enc_num_attention_heads"),
    Field(f"{_V}intermediate_size", "arch.ffn_hidden_size"),
    Field(f"{_V}hidden_act", "arch.activation", choices=tuple(ACTIVATIONS)),
    Field(f"{_V}in_channels", "family.in_channels"),
    Field(f"{_V}patch_size", "family.patch_size"),
    Field(f"{_V}temporal_patch_size", "family.temporal_patch_size"),
    Field(f"{_V}spatial_merge_size", "family.spatial_merge_size"),
)
VISION_FIELDS = (
    *QWEN_VISION_FIELDS,
    Field(f"{_V}window_size", "family.window_size"),
    Field(f"{_V}fullatt_block_indexes", "family.fullatt_block_indexes"),
    Field(f"{_V}rope_parameters.rope_theta", "family.rope_theta", default=10000.0),
)
# transformers' Qwen2_5_VLRMSNorm in the vision tower has eps 1e-6 whatever the config says.
VISION_ARCH = dict(normalization="RMSNorm", norm_eps=1e-6, linear_bias=True, gated_linear_unit=True,
                   rescale_pixels=False)
TEXT_FIELDS = (*llm_fields("text_config."), Field("tie_word_embeddings", "arch.tied_embeddings"),
               Field("text_config.rope_parameters.mrope_section", "arch.mrope_section"))


def fused_qkv(ours: str, hf: str, heads: int) -> list:
    """Qwen2.5-VL's attention: one `qkv` projection [q; k; v] (weight, bias)."""
    return [ConcatQKV(f"{ours}.{x}", f"{hf}qkv.{x}", heads) for x in ("weight", "bias")]


def vision_rules(sizes: ModelSizes, prefix: str = VISION, qkv=fused_qkv) -> list:
    """The tower's rules, its keys under `prefix`; qkv(our linear_qkv, the attention's prefix, heads):
    the attention projections' (Qwen2.5-Omni's keeps q, k, v apart)."""
    from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch

    arch = QwenVisionArch.of(sizes)
    p = arch.patch_size
    rules = [Flattened("input_embedding.weight", f"{prefix}patch_embed.proj.weight",
                       (sizes.enc_hidden_size, arch.in_channels, arch.temporal_patch_size, p, p)),
             Same("decoder.final_layernorm.weight", f"{prefix}merger.ln_q.weight"),
             *same_params("projector.encoder.linear_fc1", f"{prefix}merger.mlp.0"),
             *same_params("projector.encoder.linear_fc2", f"{prefix}merger.mlp.2")]
    for i in range(sizes.enc_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"{prefix}blocks.{i}."
        rules += [Same(f"{ours}input_layernorm.weight", f"{hf}norm1.weight"),
                  *qkv(f"{ours}self_attention.linear_qkv", f"{hf}attn.", sizes.enc_num_attention_heads),
                  *same_params(f"{ours}self_attention.linear_proj", f"{hf}attn.proj"),
                  Same(f"{ours}pre_mlp_layernorm.weight", f"{hf}norm2.weight"),
                  *(Stacked(f"{ours}mlp.linear_fc1.{x}", (f"{hf}mlp.gate_proj.{x}", f"{hf}mlp.up_proj.{x}"))
                    for x in ("weight", "bias")),
                  *same_params(f"{ours}mlp.linear_fc2", f"{hf}mlp.down_proj")]
    return rules


def text_rules(sizes: ModelSizes) -> list:
    return llm_rules(sizes, prefix=TEXT)


VISION_PART = Family("qwen2_5_vl.vision", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "vision",
                     VISION_FIELDS, hf_fixed={}, arch=VISION_ARCH, rules=vision_rules)
TEXT_PART = Family("qwen2_5_vl.text", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "llm", TEXT_FIELDS,
                   hf_fixed={"text_config.use_sliding_window": False,
                             **{f"text_config.{k}": v for k, v in ROPE.items()}},
                   arch=dict(normalization="RMSNorm", gated_linear_unit=True, qkv_bias=True), rules=text_rules)


def finish(sizes: ModelSizes, config) -> ModelSizes:
    """The merger's output is the LLM's width."""
    out = config.vision_config.out_hidden_size
    if out != sizes.hidden_size:
        raise HFMappingError(f"qwen2_5_vl: vision_config.out_hidden_size {out} differs from the text model's "
                             f"hidden_size {sizes.hidden_size}; the merger's rows must be the LLM's width")
    return sizes


def copies(sizes: ModelSizes) -> dict[str, str]:
    """A tied output layer is the embedding again (in transformers' state_dict; in some files)."""
    return {"lm_head.weight": f"{TEXT}embed_tokens.weight"} if sizes.llm_arch.tied_embeddings else {}
