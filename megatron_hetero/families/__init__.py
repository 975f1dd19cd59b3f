"""The registry of VLM families (families/base.py: what a family provides): whole Hugging Face VLMs
mapped onto our `vision` and `llm` modules. A model's family is `ModelSizes.family` (model.json);
"" is this project's own reference model, which no family describes.

A family joins by a line in REGISTRY: its name, the config.json model_types it imports, and where its
`VLMFamily` lives (imported on first use: the registry is read while flags are parsed, before
megatron-core or transformers are imported)."""

import importlib

REGISTRY = {
    # name: (config.json model_types, "module:attribute" of its VLMFamily)
    "qwen2_5_vl": (("qwen2_5_vl",), "megatron_hetero.families.qwen2_5_vl:QWEN2_5_VL"),
    "internvl": (("internvl",), "megatron_hetero.families.internvl:INTERNVL"),
    "qwen3_vl": (("qwen3_vl",), "megatron_hetero.families.qwen3_vl:QWEN3_VL"),
    "qwen3_vl_moe": (("qwen3_vl_moe",), "megatron_hetero.families.qwen3_vl:QWEN3_VL_MOE"),
    "qwen2_5_omni": (("qwen2_5_omni",), "megatron_hetero.families.qwen2_5_omni:QWEN2_5_OMNI"),
    "qwen3_omni_moe": (("qwen3_omni_moe",), "megatron_hetero.families.qwen3_omni:QWEN3_OMNI"),
}
BY_MODEL_TYPE = {model_type: name for name, (types, _) in REGISTRY.items() for model_type in types}


class UnknownFamilyError(ValueError):
    """A family (or a config model_type) no registered family maps; one line naming the known ones."""


def family_named(name: str):
    """The VLMFamily named `name` (ModelSizes.family)."""
    if name not in REGISTRY:
        raise UnknownFamilyError(f"model family {name!r} is not one this version maps; known: {', '.join(REGISTRY)}")
    module, _, attribute = REGISTRY[name][1].partition(":")
    return getattr(importlib.import_module(module), attribute)


def family_of_config(config):
    """The VLMFamily of a whole VLM's Hugging Face config."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BY_MODEL_TYPE:
        raise UnknownFamilyError(f"config model_type {model_type!r} is not a VLM family this version maps; use one "
                                 f"of {', '.join(BY_MODEL_TYPE)}")
    return family_named(BY_MODEL_TYPE[model_type])


def encoder_cp_tokens(module, sizes) -> int | None:
    """What encoder `module`'s CP ranks split (spec.rules.encoder_cp_problem): an item's tokens,
    evenly, for this project's encoders; 0 for a family's encoder that splits items of any size (a
    vision tower by whole merge blocks, `vision_cp`; an audio encoder by rows, `audio_cp`); None for
    one that does not split them."""
    from megatron_hetero.models.kinds import encoder_kind

    kind = encoder_kind(module)
    if sizes.family and kind.name in ("vision", "audio"):
        family = family_named(sizes.family)
        return 0 if (family.vision_cp if kind.name == "vision" else family.audio_cp) else None
    return kind.stage_tokens(sizes)


def encoder_stage_problem(module, sizes) -> str | None:
    """Why a family's encoder `module` cannot have its pp (a tower that runs as one stage), or None."""
    if not sizes.family or module.pp == 1:
        return None
    family = family_named(sizes.family)
    if module.kind == "vision" and family.vision_stages:
        return None
    what = "vision tower" if module.kind == "vision" else f"{module.kind} encoder"
    return f"module {module.name}: the {sizes.family} {what} runs as one pipeline stage; set its pp: 1"


__all__ = ["BY_MODEL_TYPE", "REGISTRY", "UnknownFamilyError", "encoder_cp_tokens", "encoder_stage_problem",
           "family_named", "family_of_config"]
