"""Qwen3-VL's images for conversation data: Qwen2.5-VL's (families/qwen2_5_vl/media.py: transformers'
Qwen2-VL image processor, `<|vision_start|><|image_pad|>*N<|vision_end|>`, M-RoPE positions from the
grids; transformers' Qwen3-VL get_rope_index places images as Qwen2.5-VL's does) at Qwen3-VL's
patch and merge sizes."""

from megatron_hetero.families.qwen2_5_vl.media import QwenImages, processor_settings
from megatron_hetero.families.qwen3_vl.vision import Qwen3VisionArch


def build_media(sizes, settings: dict, config: dict) -> QwenImages:
    return QwenImages(Qwen3VisionArch.of(sizes), settings, config)


__all__ = ["build_media", "processor_settings"]
