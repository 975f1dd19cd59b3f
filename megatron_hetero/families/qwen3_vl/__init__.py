"""Qwen3-VL (transformers' qwen3_vl and qwen3_vl_moe): a native-resolution ViT with a learned,
resampled position embedding and DeepStack mergers (vision.py) into a Qwen3 LLM (QK-norm; Qwen3-MoE
experts for qwen3_vl_moe, moe.py) with interleaved M-RoPE; DeepStack rows are added to the outputs of
the first LLM layers (models/vlm.py). Images as Qwen2.5-VL's (media.py); Hugging Face mapping in hf.py."""

from dataclasses import replace

from megatron_hetero.families.base import TRANSFORMERS, VLMFamily
from megatron_hetero.families.qwen3_vl import hf, moe

_HERE = "megatron_hetero.families.qwen3_vl"
QWEN3_VL = VLMFamily(
    name="qwen3_vl",
    architecture="Qwen3VLForConditionalGeneration",
    parts={"vision": hf.VISION_PART, "llm": hf.TEXT_PART},
    prefixes={"vision": (hf.VISION,), "llm": (hf.TEXT, "lm_head.")},
    vision_builder=f"{_HERE}.vision:build_vision_encoder",
    media_builder=f"{_HERE}.media:build_media",
    settings_reader=f"{_HERE}.media:processor_settings",
    finish=hf.finish,
    schemes=(TRANSFORMERS,),
    copies=hf.copies,
    deepstack=hf.deepstack,
    vision_cp=True,
)
QWEN3_VL_MOE = replace(
    QWEN3_VL,
    name="qwen3_vl_moe",
    architecture="Qwen3VLMoeForConditionalGeneration",
    parts={"vision": moe.VISION_PART, "llm": moe.TEXT_PART},
    finish=moe.finish,
    schemes=moe.SCHEMES,
)
