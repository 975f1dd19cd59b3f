"""Qwen2.5-Omni (transformers' qwen2_5_omni), its thinker as three modules: Qwen2.5-VL's vision tower
(families/qwen2_5_vl/vision.py), a Whisper-like audio encoder (audio.py) and a Qwen2 LLM with TMRoPE:
M-RoPE whose temporal ids count time for videos and audio (media.py). Both encoders split their items
over their own CP ranks (the vision tower by merge blocks, the audio encoder by rows). The talker and
token2wav pass through import and export unchanged; Hugging Face mapping in hf.py."""

from dataclasses import replace

from megatron_hetero.families.base import TRANSFORMERS
from megatron_hetero.families.qwen2_5_omni import hf
from megatron_hetero.families.qwen2_5_vl import QWEN2_5_VL

_HERE = "megatron_hetero.families.qwen2_5_omni"
# Qwen2.5-VL's vision tower (its builder, CP over merge blocks) with an audio encoder and the thinker's keys
QWEN2_5_OMNI = replace(
    QWEN2_5_VL, name=hf.NAME, architecture=hf.ARCHITECTURE, compared="Qwen2_5OmniThinkerForConditionalGeneration",
    parts={"vision": hf.VISION_PART, "audio": hf.AUDIO_PART, "llm": hf.TEXT_PART},
    prefixes={"vision": (hf.VISION,), "audio": (hf.AUDIO,), "llm": (hf.TEXT, hf.LM_HEAD)},
    audio_builder=f"{_HERE}.audio:build_audio_encoder", media_builder=f"{_HERE}.media:build_media",
    settings_reader=f"{_HERE}.media:processor_settings", finish=hf.finish, schemes=(TRANSFORMERS, hf.HUB),
    copies=hf.copies, kept=hf.KEPT, audio_cp=True)
