"""Image files to encoder inputs with Pillow: checked, resized, optionally tiled, normalized.

An image becomes one tile of `size` x `size` pixels, or with `max_tiles` > 1 a grid of tiles whose
aspect ratio is closest to the image's (LLaVA-NeXT / InternVL dynamic resolution) plus a thumbnail
of the whole image, so the number of encoder items per image varies with its shape. Pixels end in
[0, 1] and are then normalized with the encoder's constants (NORMALIZATION).
"""

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Per-channel (mean, std) of the encoders' preprocessing, by --image-normalization name (transformers'
# SiglipImageProcessor and CLIPImageProcessor defaults). "none" keeps pixels in [0, 1]: this project's
# reference vision encoder rescales them itself (VisionArch.rescale_pixels); an imported tower's
# comes with it (VisionArch.pixel_normalization).
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "none": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
    "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
}


class ImageError(ValueError):
    """An image file that cannot be used (missing, not an image, truncated)."""


@dataclass(frozen=True)
class ImageSpec:
    size: int  # side of a tile in pixels
    max_tiles: int = 1  # 1: the whole image resized to one tile
    normalization: tuple = NORMALIZATION["none"]  # (mean, std) per channel


def normalize(pixels: torch.Tensor, normalization: tuple) -> torch.Tensor:
    """Images [..., 3, H, W] in [0, 1] normalized with (mean, std) per channel."""
    mean, std = (torch.tensor(v, dtype=pixels.dtype).view(3, 1, 1) for v in normalization)
    return (pixels - mean) / std


def tile_grid(width: int, height: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) with columns x rows <= max_tiles whose aspect ratio is closest to the image's;
    among equally close grids the larger one (more detail), as InternVL chooses."""
    aspect = width / height
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles // c + 1)]
    return min(grids, key=lambda g: (abs(np.log(g[0] / g[1]) - np.log(aspect)), -g[0] * g[1]))


def tiles_of(width: int, height: int, spec: ImageSpec) -> int:
    """Encoder items an image of this size becomes (a tiled image adds a thumbnail)."""
    columns, rows = tile_grid(width, height, spec.max_tiles)
    return 1 if columns * rows == 1 else columns * rows + 1


def check_image(path) -> tuple[int, int]:
    """(width, height) of an image file, its structure checked (PNG chunk checksums, truncation)
    without decoding pixels; raises ImageError. Every rank runs this, so every rank skips the
    same samples; only the ranks that encode images decode them (load_tiles)."""
    try:
        with Image.open(path) as image:
            size = image.size
            image.verify()
    except FileNotFoundError:
        raise ImageError("missing image") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"corrupt image ({error})") from None
    return size


def _normalized(image: Image.Image, spec: ImageSpec) -> torch.Tensor:
    pixels = torch.from_numpy(np.array(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return normalize(pixels, spec.normalization)


def open_rgb(path) -> Image.Image:
    """An image file decoded to RGB; raises ImageError."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ImageError("missing image") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"corrupt image ({error})") from None


def load_tiles(path, spec: ImageSpec) -> torch.Tensor:
    """[tiles, 3, size, size] of an image file, row-major tiles then the thumbnail; raises ImageError."""
    image = open_rgb(path)
    s = spec.size
    columns, rows = tile_grid(*image.size, spec.max_tiles)
    whole = image.resize((s, s), Image.Resampling.BICUBIC)
    if columns * rows == 1:
        return _normalized(whole, spec)[None]
    grid = image.resize((columns * s, rows * s), Image.Resampling.BICUBIC)
    tiles = [grid.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(columns)]
    return torch.stack([_normalized(t, spec) for t in (*tiles, whole)])
