"""Qwen2.5-Omni (transformers' qwen2_5_omni), its thinker as three modules: Qwen2.5-VL's vision tower
(families/qwen2_5_vl/vision.py), a Whisper-like audio encoder (audio.py) and a Qwen2 LLM with TMRoPE:
M-RoPE whose temporal ids count time for videos and audio (media.py). The talker and token2wav pass
through import and export unchanged; Hugging Face mapping in hf.py."""

from megatron_hetero.families.base import TRANSFORMERS, VLMFamily
from megatron_hetero.families.qwen2_5_omni import hf

_HERE = "megatron_hetero.families.qwen2_5_omni"
QWEN2_5_OMNI = VLMFamily(
    name=hf.NAME,
    architecture=hf.ARCHITECTURE,
    parts={"vision": hf.VISION_PART, "audio": hf.AUDIO_PART, "llm": hf.TEXT_PART},
    prefixes={"vision": (hf.VISION,), "audio": (hf.AUDIO,), "llm": (hf.TEXT, hf.LM_HEAD)},
    vision_builder="megatron_hetero.families.qwen2_5_vl.vision:build_vision_encoder",
    audio_builder=f"{_HERE}.audio:build_audio_encoder",
    media_builder=f"{_HERE}.media:build_media",
    settings_reader=f"{_HERE}.media:processor_settings",
    finish=hf.finish,
    schemes=(TRANSFORMERS, hf.HUB),
    copies=hf.copies,
    kept=hf.KEPT,
    compared="Qwen2_5OmniThinkerForConditionalGeneration",
    vision_cp=True,
)
