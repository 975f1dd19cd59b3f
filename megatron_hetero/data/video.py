"""Videos to frames: a video file decoded by PyAV (transformers' own reader, so that the frames are
the ones its video processors take), or a list of frame images. A model's video processing
(families/*/media.py) picks the frames to keep from the video's metadata (`VideoInfo`: every rank
reads it without decoding, as images' sizes are read) and resizes them here as torchvision does.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from megatron_hetero.data.images import ImageError, check_image, open_rgb


class VideoError(ValueError):
    """A video that cannot be used (missing, not a video, no frames, frames of different sizes)."""


@dataclass(frozen=True)
class VideoInfo:
    """What sampling needs of a video: its frames, their rate (None for a list of frame images, as
    transformers' VideoMetadata has it for frames without metadata) and size."""

    total_frames: int
    fps: float | None
    width: int
    height: int


def _av(error: type[ValueError] = VideoError, what: str = "video"):
    try:
        import av
    except ImportError:
        raise error(f"{what} files need PyAV: pip install megatron-hetero[media]") from None
    return av


@contextmanager
def pyav_errors(error: type[ValueError] = VideoError, what: str = "video"):
    """PyAV's and the file system's errors while reading a `what` file as one `error` line: missing,
    or corrupt (FFmpeg's reason)."""
    av = _av(error, what)
    try:
        yield av
    except FileNotFoundError:
        raise error(f"missing {what}") from None
    except (av.error.FFmpegError, OSError, ValueError) as problem:
        if isinstance(problem, error):
            raise
        raise error(f"corrupt {what} ({problem})") from None


def probe_video(source) -> VideoInfo:
    """A video's VideoInfo, its frames not decoded: a file (a path or a file object) through its
    container's video stream, or a list of frame images (each checked as an image); raises VideoError."""
    if isinstance(source, (list, tuple)):
        return _probe_frames(source)
    with pyav_errors() as av, av.open(source) as container:
        if not container.streams.video:
            raise VideoError("corrupt video (no video stream)")
        stream = container.streams.video[0]
        info = VideoInfo(int(stream.frames), float(stream.average_rate or 0) or None, stream.width, stream.height)
    if info.total_frames < 1 or info.fps is None:
        # transformers' reader samples by the stream's frame count and rate
        raise VideoError("corrupt video (its stream states no frame count or rate; remux it, e.g. to .mp4)")
    return info


def _probe_frames(frames) -> VideoInfo:
    if not frames:
        raise VideoError("corrupt video (an empty list of frames)")
    try:
        sizes = {check_image(frame) for frame in frames}
    except ImageError as error:
        raise VideoError(f"{'missing' if str(error) == 'missing image' else 'corrupt'} video frame ({error})") from None
    if len(sizes) > 1:
        raise VideoError(f"corrupt video (frames of different sizes: {sorted(sizes)})")
    (width, height), = sizes
    return VideoInfo(len(frames), None, width, height)


def read_frames(source, indices: list[int]) -> torch.Tensor:
    """uint8 [len(indices), 3, H, W]: the frames `indices` of a video file (decoded in order by
    transformers' PyAV reader) or of a list of frame images; raises VideoError."""
    if isinstance(source, (list, tuple)):
        try:
            frames = np.stack([np.asarray(open_rgb(source[i])) for i in indices])
        except ImageError as error:
            raise VideoError(f"corrupt video frame ({error})") from None
        return torch.from_numpy(frames).permute(0, 3, 1, 2)
    from transformers.video_utils import read_video_pyav

    av = _av()
    try:
        frames, _ = read_video_pyav(source, lambda metadata, **kwargs: np.asarray(indices))
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise VideoError(f"corrupt video ({error})") from None
    if len(frames) != len(indices):
        raise VideoError(f"corrupt video ({len(frames)} of the {len(indices)} frames sampled decode)")
    return torch.from_numpy(frames).permute(0, 3, 1, 2)


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 frames [..., 3, H, W] resized bicubic with antialiasing as torchvision's resize does on the
    CPU (its native uint8 path: the same call, no float round trip); unchanged at their own size."""
    if frames.shape[-2:] == (height, width):
        return frames
    flat = frames.reshape(-1, *frames.shape[-3:])
    out = torch.nn.functional.interpolate(flat, size=[height, width], mode="bicubic", align_corners=False,
                                          antialias=True)
    return out.reshape(*frames.shape[:-2], height, width)


def rescale_normalize(frames: torch.Tensor, mean, std, rescale_factor: float = 1 / 255) -> torch.Tensor:
    """float32 frames [..., 3, H, W] from uint8 ones: rescaled and normalized in one step, as
    transformers' torchvision backend fuses them ((x - mean / r) / (std / r), constants in float32)."""
    mean, std = (torch.tensor(v) * (1.0 / rescale_factor) for v in (mean, std))
    return (frames.to(torch.float32) - mean.view(3, 1, 1)) / std.view(3, 1, 1)
