"""Qwen2.5-VL's images for conversation data (data/media.py's ImageProcessing): each image one item
at native resolution, resized (transformers' smart_resize) to multiples of patch x merge pixels within
the processor's min and max pixels, cut into patches by transformers' own image processor (its PIL
backend: the pixels are the model's); its `<image>` tag becomes `<|vision_start|>`, one
`<|image_pad|>` per merged patch (the rows), `<|vision_end|>`; the sequence's M-RoPE positions follow
the images' grids (models/mrope.py)."""

import json
from pathlib import Path

import numpy as np
import torch

from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.data.images import ImageError, open_rgb
from megatron_hetero.data.media import ImageItems, ImageTokens
from megatron_hetero.data.sample_batch import Media
from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch
from megatron_hetero.models.mrope import mrope_positions

PROCESSOR_FILE = "preprocessor_config.json"


def _processor_class():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


def processor_settings(model_dir: str, config) -> dict:
    """The model directory's image processor settings (transformers' serialization), or, without a
    processor file, its defaults at the vision tower's patch and merge sizes; checked against the
    tower (its patches must be the ones the tower embeds)."""
    cls, vision = _processor_class(), config.vision_config
    if Path(model_dir, PROCESSOR_FILE).is_file():
        processor = cls.from_pretrained(model_dir)
    else:
        processor = cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                        merge_size=vision.spatial_merge_size)
    for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                         ("merge_size", "spatial_merge_size")):
        if getattr(processor, ours) != getattr(vision, theirs):
            raise HFMappingError(f"{model_dir}/{PROCESSOR_FILE}: {ours} {getattr(processor, ours)} differs from "
                                 f"vision_config.{theirs} {getattr(vision, theirs)}")
    return json.loads(processor.to_json_string())


class QwenImages:
    """See the module docstring. settings: model.json's "processor"; config: its Hugging Face config."""

    def __init__(self, arch: QwenVisionArch, settings: dict, config: dict):
        self.arch = arch
        self.processor = _processor_class().from_dict(settings)
        self.image_tokens = ImageTokens((config["vision_start_token_id"],), config["image_token_id"],
                                        (config["vision_end_token_id"],))

    def items(self, width: int, height: int) -> ImageItems:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        size, patch, merge = self.processor.size, self.arch.patch_size, self.arch.spatial_merge_size
        try:
            h, w = smart_resize(height, width, patch * merge, size.shortest_edge, size.longest_edge)
        except ValueError as error:  # an aspect ratio over 200
            raise ImageError(f"corrupt image ({error})") from None
        grid = (1, h // patch, w // patch)
        return ImageItems((grid[1] * grid[2] // merge**2,), (grid[1] * grid[2],), (grid,))

    def tokens(self, tokenizer) -> ImageTokens:
        return self.image_tokens

    def media(self, images: list[ImageItems], positions: torch.Tensor) -> Media:
        grids = torch.tensor([g for i in images for g in i.grids], dtype=torch.long).reshape(-1, 3)
        patches = int(grids.prod(1).sum())
        return Media(torch.full((patches, self.arch.patch_dim), torch.nan), torch.tensor([len(grids)]), positions,
                     grids, torch.tensor([r for i in images for r in i.rows], dtype=torch.long))

    def item_tokens(self, media: Media) -> np.ndarray:
        return media.grids.prod(1).numpy()

    def pixels(self, source) -> torch.Tensor:
        return self.processor(images=[open_rgb(source)], return_tensors="pt")["pixel_values"]

    def position_ids(self, seq_len: int, image_starts: list[int], grids: list) -> torch.Tensor:
        return mrope_positions(seq_len, image_starts, grids, self.arch.spatial_merge_size)

    def hf_inputs(self, input_ids: torch.Tensor, media: Media) -> dict:
        """transformers' forward arguments beside input_ids for a sample's decoded media (hf compare)."""
        types = {"mm_token_type_ids": (input_ids == self.image_tokens.placeholder).int()}
        if media.grids is None or not len(media.grids):
            return types
        return {**types, "pixel_values": media.items, "image_grid_thw": media.grids}


def build_media(sizes, settings: dict, config: dict) -> QwenImages:
    return QwenImages(QwenVisionArch.of(sizes), settings, config)
