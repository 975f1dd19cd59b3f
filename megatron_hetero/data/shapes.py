"""Deterministic synthetic image-caption data: one coloured shape on a dark background, and a
spectrogram-like clip of the same sample: a harmonic tone whose pitch says the colour and whose
number of beats says the shape.

Every sample is a pure function of ``(seed, split, index)``, so any rank or worker can build
any sample without coordination and reruns see bit-identical data. The caption is fully
determined by the image, which makes caption accuracy a direct probe of whether the language
model actually uses the vision encoder.
"""

import operator
from dataclasses import dataclass

import numpy as np
import torch

# Channel values are far apart so the colour is recoverable from the mean shape pixel.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.1),
    "blue": (0.1, 0.2, 1.0),
    "yellow": (0.9, 0.9, 0.1),
    "purple": (0.6, 0.1, 0.8),
    "white": (0.95, 0.95, 0.95),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
VERTICALS: tuple[str, ...] = ("top", "bottom")
HORIZONTALS: tuple[str, ...] = ("left", "right")
POSITIONS: tuple[str, ...] = tuple(f"{v} {h}" for v in VERTICALS for h in HORIZONTALS)

IMAGE_WORDS: frozenset[str] = frozenset((*COLOURS, *SHAPES, *VERTICALS, *HORIZONTALS))

# A caption model that ignores the image can at best match the uniform marginals:
# colour 1/6, shape 1/4, vertical 1/2, horizontal 1/2 -> mean (1/6 + 1/4 + 1/2 + 1/2) / 4 ~= 0.354.
CHANCE_ACCURACY: float = (1 / len(COLOURS) + 1 / len(SHAPES) + 1 / len(VERTICALS) + 1 / len(HORIZONTALS)) / 4

SPLITS: tuple[str, ...] = ("train", "heldout")
SPLIT_LENGTHS: dict[str, int] = {"train": 2**20, "heldout": 4096}

BACKGROUND_NOISE = 0.1  # max noise amplitude; stays well below every colour's brightest channel
SHAPE_NOISE = 0.05
SIZE_RANGE = (0.5, 0.8)  # shape extent as a fraction of the quadrant side
AUDIO_NOISE = 0.1  # max noise amplitude of a spectrogram bin
LOUDNESS_RANGE = (0.6, 0.9)  # the fundamental's level; harmonic k has 1/k of it


def make_caption(colour: str, shape: str, position: str) -> str:
    return f"a {colour} {shape} in the {position}"


def all_captions() -> list[str]:
    """Every caption the dataset can produce, in a fixed order."""
    return [make_caption(c, s, p) for c in COLOURS for s in SHAPES for p in POSITIONS]


@dataclass(frozen=True)
class ShapesSample:
    image: torch.Tensor  # float32 [3, H, W] in [0, 1]
    audio: torch.Tensor  # float32 [mel_bins, frames] in [0, 1]
    caption: str
    colour: str
    shape: str
    position: str


def _shape_mask(shape: str, ys: np.ndarray, xs: np.ndarray, cy: float, cx: float, radius: float) -> np.ndarray:
    dy, dx = ys - cy, xs - cx
    if shape == "circle":
        return dy * dy + dx * dx <= radius * radius
    if shape == "square":
        return (np.abs(dy) <= radius) & (np.abs(dx) <= radius)
    if shape == "triangle":
        # Apex at the top, base at the bottom; half-width grows linearly from the apex.
        return (dy <= radius) & (np.abs(dx) <= (dy + radius) / 2)
    if shape == "cross":
        arm = radius / 3
        return ((np.abs(dy) <= arm) & (np.abs(dx) <= radius)) | ((np.abs(dx) <= arm) & (np.abs(dy) <= radius))
    raise ValueError(f"unknown shape {shape!r}")


def fundamental_bin(colour: str, mel_bins: int) -> int:
    """The mel bin of the tone's fundamental: distinct per colour, low colours first."""
    return 1 + COLOUR_NAMES.index(colour) * ((mel_bins - 2) // len(COLOUR_NAMES))


def beats(shape: str) -> int:
    """How often the tone sounds in a clip: 1 for a circle up to 4 for a cross."""
    return SHAPES.index(shape) + 1


def _spectrogram(rng: np.random.Generator, colour: str, shape: str, mel_bins: int, frames: int) -> np.ndarray:
    f0 = fundamental_bin(colour, mel_bins)
    level = rng.uniform(*LOUDNESS_RANGE)
    # The clip is cut into 2 * beats equal spans, the tone on in every other one, starting on.
    on = (np.arange(frames) * 2 * beats(shape) // frames) % 2 == 0
    audio = rng.random((mel_bins, frames), dtype=np.float32) * AUDIO_NOISE
    for k in range(1, (mel_bins - 1) // f0 + 1):
        audio[k * f0, on] += level / k
    return np.clip(audio, 0.0, 1.0, out=audio)


class ShapesDataset:
    """Map-style dataset of :class:`ShapesSample`; sample ``i`` depends only on (seed, split, i)."""

    def __init__(self, seed: int = 1234, split: str = "train", image_size: int = 32, mel_bins: int = 16,
                 frames: int = 32):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if image_size < 16 or image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 and >= 16, got {image_size}")
        if mel_bins < len(COLOURS) + 2:
            raise ValueError(f"mel_bins must be >= {len(COLOURS) + 2} (one pitch per colour), got {mel_bins}")
        if frames < 2 * len(SHAPES):
            raise ValueError(f"frames must be >= {2 * len(SHAPES)} (on/off spans per shape), got {frames}")
        self.seed = seed
        self.split = split
        self.image_size = image_size
        self.mel_bins, self.frames = mel_bins, frames
        self._split_id = SPLITS.index(split)
        # Pixel-centre coordinates: a pixel belongs to a shape when its centre does.
        coords = np.arange(image_size, dtype=np.float32) + 0.5
        self._ys = coords[:, None]
        self._xs = coords[None, :]

    def __len__(self) -> int:
        return SPLIT_LENGTHS[self.split]

    def _rng(self, index: int) -> np.random.Generator:
        # spawn_key gives each (split, index) its own independent child stream of the seed.
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(self._split_id, index)))

    def __getitem__(self, index: int) -> ShapesSample:
        index = operator.index(index)  # also accepts numpy / torch integers from samplers
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {self.split} split of length {n}")
        rng = self._rng(index)
        colour = COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        vertical = rng.integers(len(VERTICALS))
        horizontal = rng.integers(len(HORIZONTALS))
        position = f"{VERTICALS[vertical]} {HORIZONTALS[horizontal]}"

        # The shape stays fully inside its quadrant so the position label is unambiguous.
        quadrant = self.image_size // 2
        radius = rng.uniform(*SIZE_RANGE) * quadrant / 2
        margin = radius + 1
        cy = vertical * quadrant + rng.uniform(margin, quadrant - margin)
        cx = horizontal * quadrant + rng.uniform(margin, quadrant - margin)
        mask = _shape_mask(shape, self._ys, self._xs, cy, cx, radius)

        size = self.image_size
        image = rng.random((3, size, size), dtype=np.float32) * BACKGROUND_NOISE
        shape_pixels = np.asarray(COLOURS[colour], dtype=np.float32)[:, None] + (
            rng.random((3, int(mask.sum())), dtype=np.float32) - 0.5
        ) * (2 * SHAPE_NOISE)
        image[:, mask] = shape_pixels
        np.clip(image, 0.0, 1.0, out=image)
        # Drawn after the image, so images are those of the image-only dataset.
        audio = _spectrogram(rng, colour, shape, self.mel_bins, self.frames)
        return ShapesSample(
            image=torch.from_numpy(image),
            audio=torch.from_numpy(audio),
            caption=make_caption(colour, shape, position),
            colour=colour,
            shape=shape,
            position=position,
        )


def _parse_caption(caption: str) -> tuple[str, str, str, str] | None:
    """(colour, shape, vertical, horizontal) if ``caption`` fits the template, else None."""
    words = caption.split()
    if len(words) != 7 or words[0] != "a" or words[3:5] != ["in", "the"]:
        return None
    return words[1], words[2], words[5], words[6]


def caption_accuracy(predicted: list[str], truth: list[ShapesSample]) -> float:
    """Fraction of image-dependent slots predicted correctly.

    Each sample has 4 slots: colour, shape, vertical (top/bottom) and horizontal (left/right),
    read from the predicted caption with the dataset's template; a prediction that does not fit
    the template scores 0 on all of its slots. A model that ignores the image scores about
    ``CHANCE_ACCURACY`` (~0.354 = mean of 1/6, 1/4, 1/2, 1/2); 1.0 is perfect.
    """
    if len(predicted) != len(truth):
        raise ValueError(f"{len(predicted)} predictions for {len(truth)} samples")
    if not truth:
        raise ValueError("caption_accuracy needs at least one sample")
    correct = 0
    for caption, sample in zip(predicted, truth):
        parsed = _parse_caption(caption)
        if parsed is None:
            continue
        vertical, horizontal = sample.position.split()
        correct += sum(p == t for p, t in zip(parsed, (sample.colour, sample.shape, vertical, horizontal)))
    return correct / (4 * len(truth))
