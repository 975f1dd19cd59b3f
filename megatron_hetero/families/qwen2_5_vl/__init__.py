"""Qwen2.5-VL (transformers' qwen2_5_vl): a native-resolution ViT with windowed attention and a 2x2
patch merger (vision.py) into a Qwen2 LLM with M-RoPE; images expand to
`<|vision_start|><|image_pad|>*N<|vision_end|>` (media.py); Hugging Face mapping in hf.py."""

from megatron_hetero.families.base import TRANSFORMERS, VLMFamily
from megatron_hetero.families.qwen2_5_vl import hf

_HERE = "megatron_hetero.families.qwen2_5_vl"
QWEN2_5_VL = VLMFamily(
    name="qwen2_5_vl",
    architecture="Qwen2_5_VLForConditionalGeneration",
    parts={"vision": hf.VISION_PART, "llm": hf.TEXT_PART},
    prefixes={"vision": (hf.VISION,), "llm": (hf.TEXT, "lm_head.")},
    vision_builder=f"{_HERE}.vision:build_vision_encoder",
    media_builder=f"{_HERE}.media:build_media",
    settings_reader=f"{_HERE}.media:processor_settings",
    finish=hf.finish,
    schemes=(TRANSFORMERS, hf.HUB),
    copies=hf.copies,
    vision_cp=True,
)
