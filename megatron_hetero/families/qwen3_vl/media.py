"""Qwen3-VL's images and videos for conversation data: Qwen2.5-VL's (families/qwen2_5_vl/media.py:
transformers' Qwen2-VL image processor, `<|vision_start|><|image_pad|>*N<|vision_end|>`, M-RoPE
positions from the grids; transformers' Qwen3-VL get_rope_index places images as Qwen2.5-VL's does)
at Qwen3-VL's patch and merge sizes. Videos as transformers' Qwen3VLVideoProcessor and
Qwen3VLProcessor make them (`Qwen3Videos`): frames sampled at its fps, resized within pixel bounds
over all frames, and before each temporal patch's `<|vision_start|><|video_pad|>*N<|vision_end|>`
its time as text, `<t seconds>`; each temporal patch is placed in M-RoPE as an image."""


import numpy as np

from megatron_hetero.data.video import VideoInfo
from megatron_hetero.families.qwen2_5_vl.media import QwenImages
from megatron_hetero.families.qwen2_5_vl.media import processor_settings as qwen_settings
from megatron_hetero.families.qwen2_5_vl.video import QwenVideos, VideoSettings
from megatron_hetero.families.qwen3_vl.vision import Qwen3VisionArch

# Qwen3VLVideoProcessor's defaults.
QWEN3_VIDEO = VideoSettings(shortest_edge=128 * 32 * 32, longest_edge=32 * 32 * 768, image_mean=(0.5, 0.5, 0.5),
                            image_std=(0.5, 0.5, 0.5), patch_size=16, do_sample_frames=True, fps=2,
                            max_video_tokens=768)


class Qwen3Videos(QwenVideos):
    """See the module docstring."""

    def frames(self, info: VideoInfo) -> list[int]:
        """Qwen3VLVideoProcessor.sample_frames (all frames without sampling, as for a list of frame
        images, which transformers does not sample)."""
        s, total = self.settings, info.total_frames
        if not s.do_sample_frames or info.fps is None:
            return list(range(total))
        n = s.num_frames
        if n is None and s.fps is not None:
            n = min(max(int(total / info.fps * s.fps), s.min_frames), s.max_frames, total)
        if n is None:
            n = min(max(total, s.min_frames), s.max_frames)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def frame_size(self, info: VideoInfo, frames: int) -> tuple[int, int]:
        """(height, width) the frames are resized to, the pixel bounds over all frames
        (Qwen3VLVideoProcessor.resize)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        s = self.settings
        most = s.longest_edge
        if s.cap_pixels_per_frame:
            per_frame = min(s.max_video_tokens * s.factor**2, s.longest_edge // frames)
            per_frame = max(per_frame, int(s.shortest_edge * 1.05))
            most = per_frame * frames
        return smart_resize(frames, info.height, info.width, s.temporal_patch_size, s.factor, s.shortest_edge, most)

    def timing(self, info: VideoInfo, frames: list[int], grid: tuple[int, int, int]) -> dict:
        """Each temporal patch a run of its own after its time (Qwen3VLProcessor.replace_video_token:
        the mean time of the patch's first and last frame, at the video's rate, 24 where it states none)."""
        t, h, w = grid
        tps, rows = self.settings.temporal_patch_size, h * w // self.settings.merge_size**2
        padded = frames + [frames[-1]] * (-len(frames) % tps)
        seconds = [index / (info.fps or 24) for index in padded]
        times = [(seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps)]
        frame = (self.start, *[self.pad] * rows, self.end)
        expansion = tuple(part for time in times for part in (f"<{time:.1f} seconds>", frame))
        return dict(expansion=expansion, frames=tuple(frames), runs=((1, h, w),) * t)


def processor_settings(model_dir: str, config) -> dict:
    return qwen_settings(model_dir, config, QWEN3_VIDEO, pixel_keys=False)


def build_media(sizes, settings: dict, config: dict) -> QwenImages:
    return QwenImages(Qwen3VisionArch.of(sizes), settings, config, Qwen3Videos, QWEN3_VIDEO)


__all__ = ["build_media", "processor_settings"]
