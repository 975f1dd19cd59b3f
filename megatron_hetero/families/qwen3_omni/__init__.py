"""Qwen3-Omni (transformers' qwen3_omni_moe), its thinker as three modules: Qwen3-VL's vision tower with
DeepStack (families/qwen3_vl/vision.py), an audio encoder of its own (audio.py) and a Qwen3-MoE LLM
with interleaved M-RoPE whose temporal ids count time for videos and audio (media.py); the LLM's
experts under its own ep/etp (qwen3_vl/moe.py). The talker, its code predictor and code2wav pass
through import and export unchanged; Hugging Face mapping in hf.py."""

from dataclasses import replace

from megatron_hetero.families.base import TRANSFORMERS
from megatron_hetero.families.qwen3_omni import hf
from megatron_hetero.families.qwen3_vl import QWEN3_VL

_HERE = "megatron_hetero.families.qwen3_omni"
# Qwen3-VL's vision tower (its builder, CP over merge blocks, DeepStack) with an audio encoder and the thinker's keys
QWEN3_OMNI = replace(
    QWEN3_VL, name=hf.NAME, architecture=hf.ARCHITECTURE, compared="Qwen3OmniMoeThinkerForConditionalGeneration",
    parts={"vision": hf.VISION_PART, "audio": hf.AUDIO_PART, "llm": hf.TEXT_PART},
    prefixes={"vision": (hf.VISION,), "audio": (hf.AUDIO,), "llm": (hf.TEXT, hf.LM_HEAD)},
    audio_builder=f"{_HERE}.audio:build_audio_encoder", media_builder=f"{_HERE}.media:build_media",
    settings_reader=f"{_HERE}.media:processor_settings", finish=hf.finish,
    schemes=(TRANSFORMERS, hf.HUB), copies=lambda sizes: {}, kept=hf.KEPT)
