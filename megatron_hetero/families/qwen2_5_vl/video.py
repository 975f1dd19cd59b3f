"""Qwen's videos for conversation data, as transformers' video processors make them (their torchvision
backend reimplemented on torch alone: the same sampling, resize, fused rescale and normalize, and
patches): frames picked by the processor's fps or frame count within min/max frames, resized to
multiples of patch x merge pixels within its min/max pixels, cut into temporal patches of
`temporal_patch_size` frames (the last frame repeated to fill one) and spatial patches in the image
patches' order.

Time, as each family's model reads it: Qwen2.5-VL spaces a video's M-RoPE temporal positions by
tokens_per_second x the seconds per temporal patch (`second_per_grid_ts`; `QwenVideos`); Qwen3-VL
writes a `<t seconds>` text before each temporal patch's tokens and places each patch as an image
(`Qwen3Videos`, families/qwen3_vl/media.py).
"""

import math
from dataclasses import asdict, dataclass

import torch

from megatron_hetero.data.media import VideoItems
from megatron_hetero.data.video import VideoError, VideoInfo, read_frames, rescale_normalize, resize_frames

# The file transformers 5 reads a video processor from before preprocessor_config.json (which it
# falls back to, as the Hub's Qwen2.5-VL checkpoints have it), and the processor file that may hold
# both under "video_processor".
VIDEO_PROCESSOR_FILE, PROCESSOR_CONFIG_FILE = "video_preprocessor_config.json", "processor_config.json"


@dataclass(frozen=True)
class VideoSettings:
    """A video processor's settings (transformers' attribute names; size as its shortest_edge and
    longest_edge pixel bounds). The defaults are Qwen2VLVideoProcessor's."""

    shortest_edge: int = 128 * 28 * 28
    longest_edge: int = 28 * 28 * 768
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    def read(self, saved: dict, pixel_keys: bool) -> "VideoSettings":
        """These settings updated by a saved processor's (its other keys ignored, as transformers'
        attributes nothing reads); pixel_keys: min_pixels / max_pixels override the size's bounds
        (Qwen2VLVideoProcessor's backward compatibility)."""
        values = {k: saved[k] for k in asdict(self) if k in saved}
        size = saved.get("size") or {}
        values.update({ours: size[ours] for ours in ("shortest_edge", "longest_edge") if size.get(ours)})
        pixels = (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")) if pixel_keys else ()
        values.update({ours: saved[theirs] for ours, theirs in pixels if saved.get(theirs)})
        return self.of({**asdict(self), **values})

    @classmethod
    def of(cls, values: dict) -> "VideoSettings":
        """The settings of a dict of them (JSON's lists read as the tuples they are)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def patchify(frames: torch.Tensor, settings: VideoSettings) -> torch.Tensor:
    """[grid_t * grid_h * grid_w, C * T * P * P]: frames [n, C, H, W] as transformers' Qwen video
    processors cut them (the last frame repeated to fill the last temporal patch)."""
    tps, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    if pad := -len(frames) % tps:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    n, c, h, w = frames.shape
    t, gh, gw = n // tps, h // patch, w // patch
    patches = frames.view(t, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    return patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, c * tps * patch * patch)


class QwenVideos:
    """Qwen2.5-VL's (transformers' Qwen2VLVideoProcessor and Qwen2_5_VLProcessor): a video's tag
    becomes `<|vision_start|>`, one `<|video_pad|>` per merged patch, `<|vision_end|>`; its M-RoPE
    temporal positions step by tokens_per_second x temporal_patch_size / the sampled frame rate."""

    def __init__(self, settings: VideoSettings, config: dict):
        self.settings = settings
        self.pad = config["video_token_id"]
        self.start, self.end = config["vision_start_token_id"], config["vision_end_token_id"]
        self.tokens_per_second = config.get("vision_config", {}).get("tokens_per_second", 4)

    def frames(self, info: VideoInfo) -> list[int]:
        """The indices of the frames kept (Qwen2VLVideoProcessor.sample_frames; all without sampling,
        as for a list of frame images, which transformers does not sample)."""
        s, total = self.settings, info.total_frames
        if not s.do_sample_frames or info.fps is None:
            return list(range(total))
        tps = s.temporal_patch_size
        if s.num_frames is not None:
            n = round(s.num_frames / tps) * tps
        elif s.fps is not None:
            cap = math.floor(min(s.max_frames, total) / tps) * tps
            n = math.floor(min(max(total / info.fps * s.fps, s.min_frames), cap, total) / tps) * tps
        else:
            return list(range(total))
        if not 0 < n <= total:
            raise VideoError(f"corrupt video ({total} frames: too few to sample {max(n, tps)})")
        return torch.arange(0, total, total / n).int().tolist()

    def frame_size(self, info: VideoInfo, frames: int) -> tuple[int, int]:
        """(height, width) the frames are resized to (Qwen2VLVideoProcessor.resize)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        s = self.settings
        most = s.longest_edge
        if s.cap_pixels_per_frame:
            budget = int(s.max_video_tokens * s.factor * s.factor * 0.9)
            most = max(min(most, budget * s.temporal_patch_size // frames), int(s.shortest_edge * 1.05))
        return smart_resize(info.height, info.width, s.factor, s.shortest_edge, most)

    def items(self, info: VideoInfo) -> VideoItems:
        """The video's one encoder item: its grid, rows, the frames it keeps, its tag's tokens and
        M-RoPE spans; raises VideoError."""
        s = self.settings
        frames = self.frames(info)
        try:
            h, w = self.frame_size(info, len(frames))
        except ValueError as error:  # an aspect ratio over 200, too few frames
            raise VideoError(f"corrupt video ({error})") from None
        grid = (-(-len(frames) // s.temporal_patch_size), h // s.patch_size, w // s.patch_size)
        rows = math.prod(grid) // s.merge_size**2
        return VideoItems((rows,), (math.prod(grid),), (grid,), **self.timing(info, frames, grid))

    def sampled_fps(self, info: VideoInfo, frames: list[int]) -> float:
        """transformers' VideoMetadata.sampled_fps (24 where the video states no rate)."""
        return len(frames) / info.total_frames * info.fps if info.fps else 24.0

    def timing(self, info: VideoInfo, frames: list[int], grid: tuple[int, int, int]) -> dict:
        """VideoItems' fields that say where the video's rows go and when: one run, the whole grid,
        its temporal step in seconds per temporal patch."""
        rows = math.prod(grid) // self.settings.merge_size**2
        return dict(expansion=((self.start, *[self.pad] * rows, self.end),), frames=tuple(frames), runs=(grid,),
                    seconds_per_grid=self.settings.temporal_patch_size / self.sampled_fps(info, frames))

    def temporal_step(self, items: VideoItems) -> torch.Tensor:
        """The M-RoPE temporal step of the video's temporal patches, as get_rope_index computes it
        (tokens_per_second x second_per_grid_ts, which its processor returns as float32)."""
        return self.tokens_per_second * torch.tensor(items.seconds_per_grid, dtype=torch.float32)

    def pixels(self, source, items: VideoItems) -> torch.Tensor:
        """The video's patches [t*h*w, C*T*P*P]; raises VideoError."""
        s = self.settings
        _, gh, gw = items.grids[0]
        frames = resize_frames(read_frames(source, list(items.frames)), gh * s.patch_size, gw * s.patch_size)
        return patchify(rescale_normalize(frames, s.image_mean, s.image_std, s.rescale_factor), s)
