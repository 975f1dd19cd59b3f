"""Qwen2.5-VL's images and videos for conversation data (data/media.py's ImageProcessing): each image
one item at native resolution, resized (transformers' smart_resize) to multiples of patch x merge
pixels within the processor's min and max pixels, cut into patches by transformers' own image
processor (its PIL backend: the pixels are the model's); its `<image>` tag becomes
`<|vision_start|>`, one `<|image_pad|>` per merged patch (the rows), `<|vision_end|>`; each video one
item of the same tower as its video processor makes it (video.py); the sequence's M-RoPE positions
follow the items' grids (models/mrope.py)."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.data.images import ImageError, open_rgb
from megatron_hetero.data.media import ImageItems, ImageTokens, VideoItems
from megatron_hetero.data.sample_batch import Media
from megatron_hetero.data.video import VideoInfo
from megatron_hetero.families.qwen2_5_vl.video import (
    PROCESSOR_CONFIG_FILE,
    VIDEO_PROCESSOR_FILE,
    QwenVideos,
    VideoSettings,
)
from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch
from megatron_hetero.models.mrope import mrope_positions

PROCESSOR_FILE = "preprocessor_config.json"


def _processor_class():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


def processor_settings(model_dir: str, config, video_defaults: VideoSettings = VideoSettings(),
                       pixel_keys: bool = True) -> dict:
    """The model directory's image processor settings (transformers' serialization), or, without a
    processor file, its defaults at the vision tower's patch and merge sizes; checked against the
    tower (its patches must be the ones the tower embeds). Under "video", the video processor's
    (VideoSettings' fields) as transformers 5 reads them: processor_config.json's "video_processor",
    else video_preprocessor_config.json, else the image processor's file; video_defaults for the rest."""
    cls, vision = _processor_class(), config.vision_config
    if Path(model_dir, PROCESSOR_FILE).is_file():
        processor = cls.from_pretrained(model_dir)
    else:
        processor = cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                        merge_size=vision.spatial_merge_size)
    video = video_defaults.read(_video_file(model_dir), pixel_keys)
    for what, settings in (("", processor), ("video ", video)):
        for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
            if getattr(settings, ours) != getattr(vision, theirs):
                raise HFMappingError(f"{model_dir}: the {what}processor's {ours} {getattr(settings, ours)} differs "
                                     f"from vision_config.{theirs} {getattr(vision, theirs)}")
    return {**json.loads(processor.to_json_string()), "video": asdict(video)}


def _video_file(model_dir: str) -> dict:
    """The saved video processor settings transformers would read (none: {})."""
    combined = Path(model_dir, PROCESSOR_CONFIG_FILE)
    if combined.is_file() and "video_processor" in (whole := json.loads(combined.read_text())):
        return whole["video_processor"]
    for name in (VIDEO_PROCESSOR_FILE, PROCESSOR_FILE):
        if Path(model_dir, name).is_file():
            return json.loads(Path(model_dir, name).read_text())
    return {}


class QwenImages:
    """See the module docstring. settings: model.json's "processor"; config: its Hugging Face config."""

    def __init__(self, arch: QwenVisionArch, settings: dict, config: dict, videos: type = QwenVideos,
                 video_defaults: VideoSettings = VideoSettings()):
        self.arch = arch
        settings = dict(settings)
        video = settings.pop("video", None)  # an import without it: the defaults at the tower's patches
        video = VideoSettings.of(video) if video else replace(
            video_defaults, patch_size=arch.patch_size, temporal_patch_size=arch.temporal_patch_size,
            merge_size=arch.spatial_merge_size)
        self.videos = videos(video, config)
        self.processor = _processor_class().from_dict(settings)
        self.image_tokens = ImageTokens((config["vision_start_token_id"],), config["image_token_id"],
                                        (config["vision_end_token_id"],), (config["video_token_id"],))

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

    def video_items(self, info: VideoInfo) -> VideoItems:
        return self.videos.items(info)

    def media(self, images: list[ImageItems], positions: torch.Tensor) -> Media:
        grids = torch.tensor([g for i in images for g in i.grids], dtype=torch.long).reshape(-1, 3)
        patches = int(grids.prod(1).sum())
        return Media(torch.full((patches, self.arch.patch_dim), torch.nan), torch.tensor([len(grids)]), positions,
                     grids, torch.tensor([r for i in images for r in i.rows], dtype=torch.long))

    def item_tokens(self, media: Media) -> np.ndarray:
        return media.grids.prod(1).numpy()

    def pixels(self, source) -> torch.Tensor:
        return self.processor(images=[open_rgb(source)], return_tensors="pt")["pixel_values"]

    def video_pixels(self, source, items: VideoItems) -> torch.Tensor:
        return self.videos.pixels(source, items)

    def position_ids(self, seq_len: int, starts: list[int], items: list[ImageItems]) -> torch.Tensor:
        steps = [self.videos.temporal_step(item) if getattr(item, "seconds_per_grid", None) else 1
                 for item in items for _ in item.spans()]
        spans = [span for item in items for span in item.spans()]
        return mrope_positions(seq_len, starts, spans, self.arch.spatial_merge_size, steps)

    def hf_inputs(self, input_ids: torch.Tensor, media: Media, items: list[ImageItems]) -> dict:
        """transformers' forward arguments beside input_ids for a sample's decoded media (hf compare):
        its images' and its videos' patches and grids apart (the items hold both, in sequence order),
        each token's modality (text 0, image 1, video 2) and, where the videos say time by spacing,
        their seconds per temporal patch."""
        types = ((input_ids == self.image_tokens.placeholder).int()
                 + 2 * (input_ids == self.videos.pad).int())
        out = {"mm_token_type_ids": types}
        if not items:
            return out
        video = torch.tensor([isinstance(i, VideoItems) for i in items])
        patches = media.items.split(media.grids.prod(1).tolist())
        for keys, mine in ((("pixel_values", "image_grid_thw"), ~video),
                           (("pixel_values_videos", "video_grid_thw"), video)):
            if mine.any():
                out[keys[0]] = torch.cat([p for p, m in zip(patches, mine) if m])
                out[keys[1]] = media.grids[mine]
        seconds = [i.seconds_per_grid for i in items if isinstance(i, VideoItems) and i.seconds_per_grid]
        return {**out, "second_per_grid_ts": torch.tensor(seconds)} if seconds else out


def build_media(sizes, settings: dict, config: dict) -> QwenImages:
    return QwenImages(QwenVisionArch.of(sizes), settings, config)
