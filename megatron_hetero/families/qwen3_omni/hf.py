"""Qwen3-Omni's Hugging Face config and weights onto our modules: the thinker's vision tower
(Qwen3-VL's with DeepStack, its mergers named `ln_q`, `mlp.0`, `mlp.2`, the DeepStack ones in
`merger_list`), its audio encoder (audio.py) and its Qwen3-MoE LLM with interleaved M-RoPE (our
GPTModel with megatron-core's MoE layer, as Qwen3-VL-MoE's: qwen3_vl/moe.py). The talker (with its
code predictor) and the vocoder (code2wav) are no module of ours: their tensors pass through
unchanged (`KEPT`). Weight rules are in transformers 5's in-memory names (`thinker.model.visual.*`,
`thinker.model.audio_tower.*`, `thinker.model.language_model.*` with each layer's experts fused,
`thinker.lm_head.*`); the Hub's files (and save_pretrained's) spell them `thinker.visual.*`,
`thinker.audio_tower.*`, `thinker.model.*` with one tensor per expert and projection (HUB)."""

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.llm import ROPE, llm_fields, llm_rules
from megatron_hetero.convert.rules import HFMappingError, Same, Stacked, same_params, with_hf_names
from megatron_hetero.families.base import KeyScheme
from megatron_hetero.families.qwen2_5_omni import hf as omni_hf
from megatron_hetero.families.qwen3_vl import hf as qwen3_vl_hf
from megatron_hetero.families.qwen3_vl.moe import fused_expert_rules, with_moe
from megatron_hetero.spec.sizes import ModelSizes

NAME, ARCHITECTURE = "qwen3_omni_moe", "Qwen3OmniMoeForConditionalGeneration"
THINKER = "thinker."
VISION, AUDIO, TEXT = f"{THINKER}model.visual.", f"{THINKER}model.audio_tower.", f"{THINKER}model.language_model."
LM_HEAD = f"{THINKER}lm_head."
FILES = {VISION: f"{THINKER}visual.", AUDIO: f"{THINKER}audio_tower.", TEXT: f"{THINKER}model."}
# In-memory prefixes of the tensors no module of ours holds, carried from import to export unchanged.
KEPT = ("talker.", "code2wav.")
MERGERS = qwen3_vl_hf.MergerNames(deepstack="merger_list", norm="ln_q", fc1="mlp.0", fc2="mlp.2")

_T, _A = "thinker_config.", "thinker_config.audio_config."
VISION_FIELDS = tuple(Field(_T + f.hf, f.ours, f.default, f.choices) for f in qwen3_vl_hf.VISION_FIELDS)
AUDIO_FIELDS = (*omni_hf.AUDIO_FIELDS, Field(f"{_A}n_window_infer", "family.audio_n_window_infer"),
                Field(f"{_A}downsample_hidden_size", "family.audio_downsample_hidden_size"))
# transformers counts 13 rows per whole chunk (_get_feat_extract_output_lengths), a chunk of 100 frames
AUDIO_FIXED = {f"{_A}scale_embedding": False, f"{_A}n_window": 50}
TEXT_FIELDS = (*llm_fields(f"{_T}text_config."), Field(f"{_T}text_config.rope_parameters.mrope_section",
                                                       "arch.mrope_section"))
# Its rotary embedding interleaves the M-RoPE sections whatever the config says.
TEXT_FIXED = {f"{_T}tie_word_embeddings": False, f"{_T}text_config.attention_bias": False,
              f"{_T}text_config.decoder_sparse_step": 1, f"{_T}text_config.mlp_only_layers": [],
              f"{_T}text_config.norm_topk_prob": True, **{f"{_T}text_config.{k}": v for k, v in ROPE.items()}}
TEXT_ARCH = {**qwen3_vl_hf.TEXT_ARCH, "tied_embeddings": False}


def vision_rules(sizes: ModelSizes, prefix: str = VISION) -> list:
    return qwen3_vl_hf.vision_rules(sizes, prefix, MERGERS)


def audio_rules(sizes: ModelSizes, prefix: str = AUDIO) -> list:
    return [*(rule for name in ("conv2d1", "conv2d2", "conv2d3", "ln_post", "proj1", "proj2")
              for rule in same_params(name, f"{prefix}{name}")),
            Same("conv_out.weight", f"{prefix}conv_out.weight"),
            *omni_hf.audio_layer_rules(sizes, prefix, key_bias=True)]


def _attention_rules(sizes: ModelSizes, prefix: str) -> list:
    """The LLM's rules but its MLPs', its decoder's keys under `prefix`, its output layer thinker.lm_head."""
    rules = with_hf_names(llm_rules(sizes, prefix=prefix), lambda name: THINKER + name if name.startswith("lm_head.")
                          else name)
    return [rule for rule in rules if ".mlp." not in rule.ours]


def text_rules(sizes: ModelSizes) -> list:
    """transformers' layout: each layer's experts fused (qwen3_vl/moe.py)."""
    return _attention_rules(sizes, TEXT) + fused_expert_rules(sizes, TEXT)


def hub_text_rules(sizes: ModelSizes, prefix: str) -> list:
    """The files' layout: per layer the router and each expert's gate, up and down projections."""
    rules = _attention_rules(sizes, prefix)
    for i in range(sizes.num_layers):
        ours, hf = f"decoder.layers.{i}.mlp.", f"{prefix}layers.{i}.mlp."
        rules.append(Same(f"{ours}router.weight", f"{hf}gate.weight"))
        for e in range(sizes.llm_arch.moe.num_experts):
            mine, theirs = f"{ours}experts.local_experts.{e}.", f"{hf}experts.{e}."
            rules += [Stacked(f"{mine}linear_fc1.weight", (f"{theirs}gate_proj.weight", f"{theirs}up_proj.weight")),
                      Same(f"{mine}linear_fc2.weight", f"{theirs}down_proj.weight")]
    return rules


def _hub_rules(sizes: ModelSizes) -> dict[str, list]:
    return {"vision": vision_rules(sizes, FILES[VISION]), "audio": audio_rules(sizes, FILES[AUDIO]),
            "llm": hub_text_rules(sizes, FILES[TEXT])}


HUB = KeyScheme("hub", tuple(FILES.items()), rules=_hub_rules)
VISION_PART = Family(f"{NAME}.vision", NAME, ARCHITECTURE, "vision", VISION_FIELDS, hf_fixed={},
                     arch=qwen3_vl_hf.VISION_ARCH, rules=vision_rules)
AUDIO_PART = Family(f"{NAME}.audio", NAME, ARCHITECTURE, "audio", AUDIO_FIELDS, hf_fixed=AUDIO_FIXED, arch={},
                    rules=audio_rules)
TEXT_PART = Family(f"{NAME}.text", NAME, ARCHITECTURE, "llm", TEXT_FIELDS, hf_fixed=TEXT_FIXED, arch=TEXT_ARCH,
                   rules=text_rules)


def finish(sizes: ModelSizes, config) -> ModelSizes:
    """The audio projection's rows are the LLM's width; the vision tower's checks are Qwen3-VL's
    (merger width, DeepStack layers); the experts from text_config."""
    thinker = config.thinker_config
    if thinker.audio_config.output_dim != sizes.hidden_size:
        raise HFMappingError(f"{NAME}: thinker_config.audio_config.output_dim {thinker.audio_config.output_dim} "
                             f"differs from the text model's hidden_size {sizes.hidden_size}; the encoders' rows "
                             f"must be the LLM's width")
    return with_moe(qwen3_vl_hf.finish(sizes, thinker), thinker)


def copies(sizes: ModelSizes) -> dict[str, str]:
    """None: its embeddings are not tied (TEXT_FIXED)."""
    return {}
