"""The registry of VLM families (families/base.py: what a family provides): whole Hugging Face VLMs
mapped onto our `vision` and `llm` modules. A model's family is `ModelSizes.family` (model.json);
"" is this project's own reference model, which no family describes."""

from megatron_hetero.families.base import KeyScheme, VLMFamily
from megatron_hetero.families.internvl import INTERNVL
from megatron_hetero.families.qwen2_5_vl import QWEN2_5_VL

# A family joins by being listed here.
_FAMILIES = (QWEN2_5_VL, INTERNVL)
FAMILIES = {family.name: family for family in _FAMILIES}
BY_MODEL_TYPE = {model_type: family for family in _FAMILIES for model_type in family.model_types}


class UnknownFamilyError(ValueError):
    """A family (or a config model_type) no registered family maps; one line naming the known ones."""


def family_named(name: str) -> VLMFamily:
    if name not in FAMILIES:
        raise UnknownFamilyError(f"model family {name!r} is not one this version maps; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_config(config) -> VLMFamily:
    """The family of a whole VLM's Hugging Face config."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BY_MODEL_TYPE:
        raise UnknownFamilyError(f"config model_type {model_type!r} is not a VLM family this version maps; use one of "
                                 f"{', '.join(BY_MODEL_TYPE)} (or import --vision DIR --llm DIR for a LLaVA-style model)")
    return BY_MODEL_TYPE[model_type]


__all__ = ["BY_MODEL_TYPE", "FAMILIES", "KeyScheme", "UnknownFamilyError", "VLMFamily", "family_named",
           "family_of_config"]
