"""InternVL (transformers' internvl): InternViT, pixel shuffle and an MLP projector (vision.py) into a
Qwen2, Qwen3 or Llama LLM; images are cut into 448-pixel tiles (and a thumbnail) and each tile's 256
rows fill `<IMG_CONTEXT>` tokens between `<img>` and `</img>` (media.py); Hugging Face mapping in hf.py."""

from megatron_hetero.families.base import TRANSFORMERS, VLMFamily
from megatron_hetero.families.internvl import hf

_HERE = "megatron_hetero.families.internvl"
INTERNVL = VLMFamily(
    name="internvl",
    architecture="InternVLForConditionalGeneration",
    parts={"vision": hf.VISION_PART, "llm": hf.TEXT_PART},
    prefixes={"vision": (hf.VISION, hf.PROJECTOR), "llm": (hf.TEXT, "lm_head.")},
    vision_builder=f"{_HERE}.vision:build_vision_encoder",
    media_builder=f"{_HERE}.media:build_media",
    settings_reader=f"{_HERE}.media:processor_settings",
    finish=hf.finish,
    schemes=(TRANSFORMERS, hf.HF_FILES, hf.OPENGVLAB),
    copies=hf.copies,
    vision_stages=True,
)
