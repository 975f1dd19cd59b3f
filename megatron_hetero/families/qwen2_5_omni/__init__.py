"""Qwen2.5-Omni (transformers' qwen2_5_omni), its thinker as three modules: Qwen2.5-VL's vision tower
(families/qwen2_5_vl/vision.py), a Whisper-like audio encoder (audio.py) and a Qwen2 LLM with TMRoPE:
M-RoPE whose temporal ids count time for videos and audio (media.py). Both encoders split their items
over their own CP ranks (the vision tower by merge blocks, the audio encoder by rows). The talker and
token2wav pass through import and export unchanged; Hugging Face mapping in hf.py."""

from dataclasses import replace

from megatron_hetero.families.base import TRANSFORMERS, VLMFamily
from megatron_hetero.families.qwen2_5_omni import hf
from megatron_hetero.families.qwen2_5_vl import QWEN2_5_VL


def omni_family(base: VLMFamily, mapping, here: str, compared: str, audio_cp: bool = False) -> VLMFamily:
    """An omni model's thinker as a family: `base`'s vision tower (its builder, CP, DeepStack) beside
    an audio encoder, the Hugging Face mapping of module `mapping` (its parts, prefixes, schemes and
    kept tensors), the audio builder and media of package `here`; `compared`: the thinker's class;
    audio_cp: its audio encoder splits each audio over the audio module's CP ranks."""
    return replace(
        base, name=mapping.NAME, architecture=mapping.ARCHITECTURE, compared=compared,
        parts={"vision": mapping.VISION_PART, "audio": mapping.AUDIO_PART, "llm": mapping.TEXT_PART},
        prefixes={"vision": (mapping.VISION,), "audio": (mapping.AUDIO,), "llm": (mapping.TEXT, mapping.LM_HEAD)},
        audio_builder=f"{here}.audio:build_audio_encoder", media_builder=f"{here}.media:build_media",
        settings_reader=f"{here}.media:processor_settings", finish=mapping.finish,
        schemes=(TRANSFORMERS, mapping.HUB), copies=mapping.copies, kept=mapping.KEPT,
        audio_cp=audio_cp)


QWEN2_5_OMNI = omni_family(QWEN2_5_VL, hf, "megatron_hetero.families.qwen2_5_omni",
                           "Qwen2_5OmniThinkerForConditionalGeneration", audio_cp=True)
