"""The families we map, found from a Hugging Face config."""

from megatron_hetero.convert.family import Family
from megatron_hetero.convert.llm import LLAMA, QWEN2, QWEN3
from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.convert.vision import CLIP, SIGLIP

FAMILIES = {family.model_type: family for family in (LLAMA, QWEN2, QWEN3, SIGLIP, CLIP)}
# Text + vision checkpoints, whose vision tower is the part VLMs use.
DUAL_ENCODERS = {"siglip": SIGLIP, "clip": CLIP}


def family_of(config) -> tuple[Family, object]:
    """(family, its config) of a Hugging Face config (a PretrainedConfig): for a text + vision
    checkpoint, the vision tower's family and config."""
    model_type = getattr(config, "model_type", None)
    if model_type in DUAL_ENCODERS:
        return DUAL_ENCODERS[model_type], config.vision_config
    if model_type not in FAMILIES:
        supported = ", ".join([*FAMILIES, *DUAL_ENCODERS])
        raise HFMappingError(f"config model_type {model_type!r} is not supported; use one of {supported}")
    return FAMILIES[model_type], config
