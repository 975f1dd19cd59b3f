"""Qwen3-VL's Hugging Face config and weights onto our modules: the vision tower with its DeepStack
mergers (vision.py) and a Qwen3 LLM (QK-norm) with interleaved M-RoPE (our GPTModel). Weight rules
are in transformers 5's in-memory names (`model.visual.*`, `model.language_model.*`, `lm_head.*`),
which the Hub's Qwen3-VL files use too. Qwen3-VL-MoE's LLM is in moe.py."""

from dataclasses import dataclass

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.llm import ROPE, llm_rules
from megatron_hetero.convert.rules import ConcatQKV, Flattened, HFMappingError, Same, same_params
from megatron_hetero.families.qwen2_5_vl.hf import QWEN_VISION_FIELDS, TEXT_FIELDS
from megatron_hetero.spec.sizes import ModelSizes

VISION, TEXT = "model.visual.", "model.language_model."

_V = "vision_config."
VISION_FIELDS = (
    *QWEN_VISION_FIELDS,
    Field(f"{_V}num_position_embeddings", "family.num_position_embeddings"),
    Field(f"{_V}deepstack_visual_indexes", "family.deepstack_visual_indexes"),
    Field(f"{_V}rope_parameters.rope_theta", "family.rope_theta", default=10000.0),
)
# transformers' Qwen3-VL vision LayerNorms have eps 1e-6 whatever the config says.
VISION_ARCH = dict(normalization="LayerNorm", norm_eps=1e-6, linear_bias=True, gated_linear_unit=False,
                   rescale_pixels=False)
TEXT_FIXED = {"text_config.attention_bias": False, "text_config.rope_parameters.mrope_interleaved": True,
              **{f"text_config.{k}": v for k, v in ROPE.items()}}
TEXT_ARCH = dict(normalization="RMSNorm", gated_linear_unit=True, qk_norm=True, mrope_interleaved=True)


@dataclass(frozen=True)
class MergerNames:
    """How a Qwen3 tower's files name its mergers: the DeepStack mergers' list, and in each merger
    its LayerNorm and its MLP's two linear layers (Qwen3-Omni's tower: `merger_list`, `ln_q`,
    `mlp.0`, `mlp.2`)."""

    deepstack: str = "deepstack_merger_list"
    norm: str = "norm"
    fc1: str = "linear_fc1"
    fc2: str = "linear_fc2"

    def rules(self, ours: str, hf: str) -> list:
        """A merger's MLP (the projector's encoder, ours) under `hf`."""
        return [*same_params(f"{ours}.linear_fc1", f"{hf}.{self.fc1}"),
                *same_params(f"{ours}.linear_fc2", f"{hf}.{self.fc2}")]


def vision_rules(sizes: ModelSizes, prefix: str = VISION, names: MergerNames = MergerNames()) -> list:
    """The tower's rules, its keys under `prefix`, its mergers named as `names` says."""
    from megatron_hetero.families.qwen3_vl.vision import Qwen3VisionArch

    arch = Qwen3VisionArch.of(sizes)
    p = arch.patch_size
    rules = [Flattened("input_embedding.weight", f"{prefix}patch_embed.proj.weight",
                       (sizes.enc_hidden_size, arch.in_channels, arch.temporal_patch_size, p, p)),
             Same("input_embedding.bias", f"{prefix}patch_embed.proj.bias"),
             Same("position_embedding.weight", f"{prefix}pos_embed.weight"),
             *same_params("decoder.final_layernorm", f"{prefix}merger.{names.norm}"),
             *names.rules("projector.encoder", f"{prefix}merger")]
    for k in range(len(arch.deepstack_visual_indexes)):
        hf = f"{prefix}{names.deepstack}.{k}"
        rules += [*same_params(f"deepstack.{k}.norm", f"{hf}.{names.norm}"),
                  *names.rules(f"deepstack.{k}.projector.encoder", hf)]
    for i in range(sizes.enc_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"{prefix}blocks.{i}."
        rules += [*same_params(f"{ours}input_layernorm", f"{hf}norm1"),
                  *(ConcatQKV(f"{ours}self_attention.linear_qkv.{x}", f"{hf}attn.qkv.{x}",
                              sizes.enc_num_attention_heads) for x in ("weight", "bias")),
                  *same_params(f"{ours}self_attention.linear_proj", f"{hf}attn.proj"),
                  *same_params(f"{ours}pre_mlp_layernorm", f"{hf}norm2"),
                  *same_params(f"{ours}mlp.linear_fc1", f"{hf}mlp.linear_fc1"),
                  *same_params(f"{ours}mlp.linear_fc2", f"{hf}mlp.linear_fc2")]
    return rules


def text_rules(sizes: ModelSizes) -> list:
    return llm_rules(sizes, prefix=TEXT)


def vision_part(model_type: str, architecture: str) -> Family:
    return Family(f"{model_type}.vision", model_type, architecture, "vision", VISION_FIELDS, hf_fixed={},
                  arch=VISION_ARCH, rules=vision_rules)


VISION_PART = vision_part("qwen3_vl", "Qwen3VLForConditionalGeneration")
TEXT_PART = Family("qwen3_vl.text", "qwen3_vl", "Qwen3VLForConditionalGeneration", "llm", TEXT_FIELDS,
                   hf_fixed=TEXT_FIXED, arch=TEXT_ARCH, rules=text_rules)


def finish(sizes: ModelSizes, config) -> ModelSizes:
    """The mergers' output is the LLM's width; DeepStack rows go to the first LLM layers, one each."""
    out, name = config.vision_config.out_hidden_size, config.model_type
    if out != sizes.hidden_size:
        raise HFMappingError(f"{name}: vision_config.out_hidden_size {out} differs from the text model's "
                             f"hidden_size {sizes.hidden_size}; the merger's rows must be the LLM's width")
    indexes = list(config.vision_config.deepstack_visual_indexes)
    if len(indexes) > sizes.num_layers or any(not 0 <= i < sizes.enc_num_layers for i in indexes):
        raise HFMappingError(f"{name}: vision_config.deepstack_visual_indexes {indexes} must name vision layers "
                             f"(0..{sizes.enc_num_layers - 1}), at most one per LLM layer ({sizes.num_layers})")
    return sizes


def copies(sizes: ModelSizes) -> dict[str, str]:
    """A tied output layer is the embedding again (in transformers' state_dict; in some files)."""
    return {"lm_head.weight": f"{TEXT}embed_tokens.weight"} if sizes.llm_arch.tied_embeddings else {}


def deepstack(sizes: ModelSizes) -> tuple[int, ...]:
    """The vision layers whose DeepStack rows go to LLM layers 0, 1, ..."""
    return tuple(sizes.family_arch.get("deepstack_visual_indexes", ()))
