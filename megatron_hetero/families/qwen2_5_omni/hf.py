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
    FusedQKV,
    HFMappingError,
    KeylessBias,
    same_params,
    with_hf_names,
)
from megatron_hetero.families.base import KeyScheme
from megatron_hetero.families.qwen2_5_vl import hf as qwen_vl_hf
from megatron_hetero.families.qwen2_5_vl.hf import VISION_ARCH
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
VISION_FIELDS = tuple(Field(_V + f.hf.removeprefix("vision_config."), f.ours, f.default, f.choices)
                      for f in qwen_vl_hf.VISION_FIELDS)
# (audio_config field, ours): the audio_* sizes, and the rest in family_arch (audio.py's OmniAudioArch)
AUDIO_FIELDS = tuple(Field(_A + hf, ours, choices=tuple(ACTIVATIONS) if hf == "activation_function" else ())
                     for hf, ours in (("d_model", "audio_hidden_size"), ("encoder_layers", "audio_num_layers"),
                                      ("encoder_attention_heads", "audio_num_attention_heads"),
                                      ("num_mel_bins", "audio_mel_bins"),
                                      ("encoder_ffn_dim", "family.audio_ffn_hidden_size"),
                                      ("activation_function", "family.audio_activation"),
                                      ("n_window", "family.audio_n_window"),
                                      ("max_source_positions", "family.audio_max_source_positions"),
                                      ("output_dim", "family.audio_output_dim")))
TEXT_FIELDS = (*llm_fields(f"{_T}text_config."), Field(f"{_T}text_config.tie_word_embeddings", "arch.tied_embeddings"),
               Field(f"{_T}text_config.rope_parameters.mrope_section", "arch.mrope_section"))


def separate_qkv(ours: str, hf: str, heads: int) -> list:
    """Qwen2.5-Omni's vision attention: q, k, v projections apart (weight, bias)."""
    return [FusedQKV(f"{ours}.{x}", tuple(f"{hf}{n}.{x}" for n in "qkv"), heads, heads) for x in ("weight", "bias")]


def vision_rules(sizes: ModelSizes) -> list:
    return qwen_vl_hf.vision_rules(sizes, VISION, separate_qkv)


def audio_rules(sizes: ModelSizes) -> list:
    """The Whisper-like encoder: its key projection has no bias (ours is zero there: KeylessBias)."""
    return [*same_params("conv1", f"{AUDIO}conv1"), *same_params("conv2", f"{AUDIO}conv2"),
            *same_params("ln_post", f"{AUDIO}ln_post"), *same_params("proj", f"{AUDIO}proj"),
            *audio_layer_rules(sizes, AUDIO)]


def audio_layer_rules(sizes: ModelSizes, prefix: str, key_bias: bool = False) -> list:
    """A Whisper-like encoder's layers under `prefix`; `key_bias`: its key projection has a bias
    (Qwen3-Omni's), else ours is zero there (KeylessBias)."""
    heads = sizes.audio_num_attention_heads
    rules = []
    for i in range(sizes.audio_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"{prefix}layers.{i}."
        qkv = tuple(f"{hf}self_attn.{n}_proj." for n in "qkv")
        bias = f"{ours}self_attention.linear_qkv.bias"
        rules += [*same_params(f"{ours}input_layernorm", f"{hf}self_attn_layer_norm"),
                  FusedQKV(f"{ours}self_attention.linear_qkv.weight", tuple(f"{x}weight" for x in qkv), heads, heads),
                  FusedQKV(bias, tuple(f"{x}bias" for x in qkv), heads, heads) if key_bias
                  else KeylessBias(bias, (f"{qkv[0]}bias", f"{qkv[2]}bias"), heads),
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
