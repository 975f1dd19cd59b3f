"""Qwen2.5-Omni's Hugging Face config and weights onto our modules: the thinker's vision tower
(Qwen2.5-VL's, its attention's q, k, v kept apart in the files), its audio encoder (audio.py) and its
Qwen2 LLM with TMRoPE (our GPTModel). The talker and the vocoder (token2wav) are no module of ours:
their tensors pass through unchanged (`KEPT`). Weight rules are in transformers 5's in-memory names
(`thinker.model.visual.*`, `thinker.model.audio_tower.*`, `thinker.model.language_model.*`,
`thinker.lm_head.*`); the Hub's files spell them `thinker.visual.*`, `thinker.audio_tower.*`,
`thinker.model.*` (HUB below)."""

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.llm import ROPE, llm_fields, llm_rules
from megatron_hetero.convert.rules import (
    Flattened,
    FusedQKV,
    HFMappingError,
    KeylessBias,
    Same,
    Stacked,
    same_params,
    with_hf_names,
)
from megatron_hetero.families.base import KeyScheme
from megatron_hetero.families.qwen2_5_vl.hf import QWEN_VISION_FIELDS, VISION_ARCH
from megatron_hetero.spec.sizes import ACTIVATIONS, ModelSizes

THINKER = "thinker."
VISION, AUDIO, TEXT = f"{THINKER}model.visual.", f"{THINKER}model.audio_tower.", f"{THINKER}model.language_model."
LM_HEAD = f"{THINKER}lm_head."
HUB = KeyScheme("hub", ((VISION, f"{THINKER}visual."), (AUDIO, f"{THINKER}audio_tower."), (TEXT, f"{THINKER}model.")))
# In-memory prefixes of the tensors no module of ours holds, carried from import to export unchanged:
# the speech generator (talker, token2wav) and the audio tower's bos/eos embedding, which the
# thinker's forward does not read.
KEPT = ("talker.", "token2wav.", f"{AUDIO}audio_bos_eos_token.")

_T, _V, _A = "thinker_config.", "thinker_config.vision_config.", "thinker_config.audio_config."
VISION_FIELDS = (
    *(Field(f.hf.replace("vision_config.", _V), f.ours, f.default, f.choices) for f in QWEN_VISION_FIELDS),
    Field(f"{_V}window_size", "family.window_size"),
    Field(f"{_V}fullatt_block_indexes", "family.fullatt_block_indexes"),
    Field(f"{_V}rope_parameters.rope_theta", "family.rope_theta", default=10000.0),
)
AUDIO_FIELDS = (
    Field(f"{_A}d_model", "audio_hidden_size"),
    Field(f"{_A}encoder_layers", "audio_num_layers"),
    Field(f"{_A}encoder_attention_heads", "audio_num_attention_heads"),
    Field(f"{_A}num_mel_bins", "audio_mel_bins"),
    Field(f"{_A}encoder_ffn_dim", "family.audio_ffn_hidden_size"),
    Field(f"{_A}activation_function", "family.audio_activation", choices=tuple(ACTIVATIONS)),
    Field(f"{_A}n_window", "family.audio_n_window"),
    Field(f"{_A}max_source_positions", "family.audio_max_source_positions"),
    Field(f"{_A}output_dim", "family.audio_output_dim"),
)
TEXT_FIELDS = (*llm_fields(f"{_T}text_config."), Field(f"{_T}text_config.tie_word_embeddings", "arch.tied_embeddings"),
               Field(f"{_T}text_config.rope_parameters.mrope_section", "arch.mrope_section"))


def vision_rules(sizes: ModelSizes) -> list:
    from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch

    arch, heads = QwenVisionArch.of(sizes), sizes.enc_num_attention_heads
    p = arch.patch_size
    rules = [Flattened("input_embedding.weight", f"{VISION}patch_embed.proj.weight",
                       (sizes.enc_hidden_size, arch.in_channels, arch.temporal_patch_size, p, p)),
             Same("decoder.final_layernorm.weight", f"{VISION}merger.ln_q.weight"),
             *same_params("projector.encoder.linear_fc1", f"{VISION}merger.mlp.0"),
             *same_params("projector.encoder.linear_fc2", f"{VISION}merger.mlp.2")]
    for i in range(sizes.enc_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"{VISION}blocks.{i}."
        rules += [Same(f"{ours}input_layernorm.weight", f"{hf}norm1.weight"),
                  *(FusedQKV(f"{ours}self_attention.linear_qkv.{x}", tuple(f"{hf}attn.{n}.{x}" for n in "qkv"),
                             heads, heads) for x in ("weight", "bias")),
                  *same_params(f"{ours}self_attention.linear_proj", f"{hf}attn.proj"),
                  Same(f"{ours}pre_mlp_layernorm.weight", f"{hf}norm2.weight"),
                  *(Stacked(f"{ours}mlp.linear_fc1.{x}", (f"{hf}mlp.gate_proj.{x}", f"{hf}mlp.up_proj.{x}"))
                    for x in ("weight", "bias")),
                  *same_params(f"{ours}mlp.linear_fc2", f"{hf}mlp.down_proj")]
    return rules


def audio_rules(sizes: ModelSizes) -> list:
    """The Whisper-like encoder: its key projection has no bias (ours is zero there: KeylessBias)."""
    heads = sizes.audio_num_attention_heads
    rules = [*same_params("conv1", f"{AUDIO}conv1"), *same_params("conv2", f"{AUDIO}conv2"),
             *same_params("ln_post", f"{AUDIO}ln_post"), *same_params("proj", f"{AUDIO}proj")]
    for i in range(sizes.audio_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"{AUDIO}layers.{i}."
        qkv = tuple(f"{hf}self_attn.{n}_proj." for n in "qkv")
        rules += [*same_params(f"{ours}input_layernorm", f"{hf}self_attn_layer_norm"),
                  FusedQKV(f"{ours}self_attention.linear_qkv.weight", tuple(f"{x}weight" for x in qkv), heads, heads),
                  KeylessBias(f"{ours}self_attention.linear_qkv.bias", (f"{qkv[0]}bias", f"{qkv[2]}bias"), heads),
                  *same_params(f"{ours}self_attention.linear_proj", f"{hf}self_attn.out_proj"),
                  *same_params(f"{ours}pre_mlp_layernorm", f"{hf}final_layer_norm"),
                  *same_params(f"{ours}mlp.linear_fc1", f"{hf}fc1"),
                  *same_params(f"{ours}mlp.linear_fc2", f"{hf}fc2")]
    return rules


def text_rules(sizes: ModelSizes) -> list:
    return with_hf_names(llm_rules(sizes, prefix=TEXT), lambda name: THINKER + name if name.startswith("lm_head.")
                         else name)


NAME, ARCHITECTURE = "qwen2_5_omni", "Qwen2_5OmniForConditionalGeneration"
VISION_PART = Family(f"{NAME}.vision", NAME, ARCHITECTURE, "vision", VISION_FIELDS, hf_fixed={}, arch=VISION_ARCH,
                     rules=vision_rules)
AUDIO_PART = Family(f"{NAME}.audio", NAME, ARCHITECTURE, "audio", AUDIO_FIELDS,
                    hf_fixed={f"{_A}scale_embedding": False}, arch={}, rules=audio_rules)
TEXT_PART = Family(f"{NAME}.text", NAME, ARCHITECTURE, "llm", TEXT_FIELDS,
                   hf_fixed={f"{_T}text_config.use_sliding_window": False,
                             **{f"{_T}text_config.{k}": v for k, v in ROPE.items()}},
                   arch=dict(normalization="RMSNorm", gated_linear_unit=True, qkv_bias=True), rules=text_rules)


def finish(sizes: ModelSizes, config) -> ModelSizes:
    """The vision merger's and the audio projection's rows are the LLM's width."""
    thinker = config.thinker_config
    for what, width in (("vision_config.out_hidden_size", thinker.vision_config.out_hidden_size),
                        ("audio_config.output_dim", thinker.audio_config.output_dim)):
        if width != sizes.hidden_size:
            raise HFMappingError(f"{NAME}: thinker_config.{what} {width} differs from the text model's hidden_size "
                                 f"{sizes.hidden_size}; the encoders' rows must be the LLM's width")
    return sizes


def copies(sizes: ModelSizes) -> dict[str, str]:
    """A tied output layer is the embedding again (in transformers' state_dict; in some files)."""
    return {f"{LM_HEAD}weight": f"{TEXT}embed_tokens.weight"} if sizes.llm_arch.tied_embeddings else {}
