"""Tests for the synthetic shapes dataset, its caption metric and the caption tokenizer."""

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from megatron_hetero.data.batches import AUDIO, VISION, caption_batch
from megatron_hetero.data.shapes import (
    CHANCE_ACCURACY,
    COLOURS,
    HORIZONTALS,
    IMAGE_WORDS,
    POSITIONS,
    SHAPES,
    VERTICALS,
    ShapesDataset,
    ShapesSample,
    all_captions,
    beats,
    caption_accuracy,
    fundamental_bin,
)
from megatron_hetero.data.tokenizer import DEFAULT_MODEL_PATH, CaptionTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
# Background noise stays below 0.1 and every colour has a channel >= 0.8, so this separates them.
SHAPE_THRESHOLD = 0.4


def shape_mask(image: torch.Tensor) -> torch.Tensor:
    return image.max(dim=0).values > SHAPE_THRESHOLD


def image_digest(dataset: ShapesDataset, indices) -> str:
    digest = hashlib.sha256()
    for i in indices:
        digest.update(dataset[i].image.numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def train_samples() -> list[ShapesSample]:
    dataset = ShapesDataset()
    return [dataset[i] for i in range(400)]


@pytest.fixture(scope="module")
def tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer()


def sample(colour: str, shape: str, position: str) -> ShapesSample:
    return ShapesSample(
        image=torch.zeros(3, 32, 32),
        audio=torch.zeros(16, 32),
        caption=f"a {colour} {shape} in the {position}",
        colour=colour,
        shape=shape,
        position=position,
    )


# --- dataset -------------------------------------------------------------------------------


def test_same_index_gives_identical_sample():
    dataset = ShapesDataset(seed=7)
    for i in (0, 1, 12345, len(dataset) - 1):
        first, again, fresh = dataset[i], dataset[i], ShapesDataset(seed=7)[i]
        assert torch.equal(first.image, again.image)
        assert torch.equal(first.image, fresh.image)
        assert first.caption == fresh.caption


def test_identical_in_another_process():
    indices = list(range(5))
    script = (
        "import hashlib\n"
        "from megatron_hetero.data.shapes import ShapesDataset\n"
        "dataset, digest = ShapesDataset(seed=3, split='heldout'), hashlib.sha256()\n"
        f"for i in {indices}:\n"
        "    digest.update(dataset[i].image.numpy().tobytes())\n"
        "print(digest.hexdigest())\n"
    )
    # A different hash seed guards against any dependence on set/dict iteration order.
    env = dict(os.environ, PYTHONHASHSEED="99")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == image_digest(ShapesDataset(seed=3, split="heldout"), indices)


def test_splits_and_seeds_differ():
    train, heldout, other_seed = ShapesDataset(split="train"), ShapesDataset(split="heldout"), ShapesDataset(seed=1)
    for i in range(20):
        assert not torch.equal(train[i].image, heldout[i].image)
        assert not torch.equal(train[i].image, other_seed[i].image)


def test_lengths_and_indexing():
    train, heldout = ShapesDataset(split="train"), ShapesDataset(split="heldout")
    assert len(train) == 2**20
    assert len(heldout) == 4096
    assert torch.equal(heldout[-1].image, heldout[len(heldout) - 1].image)
    with pytest.raises(IndexError):
        heldout[len(heldout)]
    with pytest.raises(ValueError):
        ShapesDataset(split="test")
    with pytest.raises(ValueError):
        ShapesDataset(image_size=30)


@pytest.mark.parametrize("image_size", [32, 64])
def test_image_format(image_size):
    image = ShapesDataset(image_size=image_size)[0].image
    assert image.shape == (3, image_size, image_size)
    assert image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0


def test_caption_matches_attributes(train_samples):
    for s in train_samples:
        assert s.caption == f"a {s.colour} {s.shape} in the {s.position}"
        assert s.colour in COLOURS and s.shape in SHAPES and s.position in POSITIONS


def test_every_attribute_value_appears(train_samples):
    assert {s.colour for s in train_samples} == set(COLOURS)
    assert {s.shape for s in train_samples} == set(SHAPES)
    assert {s.position for s in train_samples} == set(POSITIONS)


def test_shape_lies_in_its_quadrant(train_samples):
    for s in train_samples:
        mask = shape_mask(s.image)
        half = mask.shape[0] // 2
        vertical, horizontal = s.position.split()
        rows = slice(0, half) if vertical == "top" else slice(half, None)
        cols = slice(0, half) if horizontal == "left" else slice(half, None)
        assert mask[rows, cols].sum() >= 16, s.caption
        assert mask.sum() == mask[rows, cols].sum(), s.caption


def test_mean_shape_colour_identifies_colour(train_samples):
    palette = torch.tensor(list(COLOURS.values()))
    redness = {colour: [] for colour in COLOURS}
    for s in train_samples:
        mean_rgb = s.image[:, shape_mask(s.image)].mean(dim=1)
        assert list(COLOURS)[torch.cdist(mean_rgb[None], palette).argmin()] == s.colour
        redness[s.colour].append(float(mean_rgb[0] - mean_rgb[1:].max()))
    mean_redness = {colour: sum(v) / len(v) for colour, v in redness.items()}
    assert max(mean_redness, key=mean_redness.get) == "red"


def test_image_words():
    assert IMAGE_WORDS == set(COLOURS) | set(SHAPES) | set(VERTICALS) | set(HORIZONTALS)
    assert len(IMAGE_WORDS) == 14


def test_accuracy_perfect(train_samples):
    assert caption_accuracy([s.caption for s in train_samples], train_samples) == 1.0


def test_accuracy_garbage(train_samples):
    garbage = ["", "hello world", "a red circle", "a red circle in the top left corner", "red circle in the top left"]
    truth = train_samples[: len(garbage)]
    assert caption_accuracy(garbage, truth) == 0.0


def test_accuracy_partial():
    truth = [
        sample("red", "circle", "top left"),
        sample("blue", "cross", "bottom right"),
        sample("green", "triangle", "top right"),
        sample("green", "triangle", "bottom left"),
    ]
    predicted = [
        "a red square in the top right",  # colour, vertical -> 2
        "a blue cross in the bottom right",  # all -> 4
        "the green triangle",  # unparseable -> 0
        "a yellow circle in the top left",  # horizontal -> 1
    ]
    assert caption_accuracy(predicted, truth) == 7 / 16


def test_accuracy_rejects_length_mismatch(train_samples):
    with pytest.raises(ValueError):
        caption_accuracy(["a red circle in the top left"], train_samples[:2])


def test_constant_prediction_scores_chance():
    assert CHANCE_ACCURACY == pytest.approx((1 / 6 + 1 / 4 + 1 / 2 + 1 / 2) / 4)
    heldout = ShapesDataset(split="heldout")
    truth = [heldout[i] for i in range(2000)]
    constant = ["a red circle in the top left"] * len(truth)
    assert caption_accuracy(constant, truth) == pytest.approx(CHANCE_ACCURACY, abs=0.03)


# --- audio ---------------------------------------------------------------------------------


def test_spectrogram_is_deterministic():
    dataset = ShapesDataset(seed=7)
    for i in (0, 1, 4095):
        assert torch.equal(dataset[i].audio, ShapesDataset(seed=7)[i].audio)
        assert not torch.equal(dataset[i].audio, ShapesDataset(seed=8)[i].audio)
        assert not torch.equal(dataset[i].audio, ShapesDataset(seed=7, split="heldout")[i].audio)


@pytest.mark.parametrize("mel_bins, frames", [(16, 32), (8, 12)])
def test_spectrogram_format(mel_bins, frames):
    audio = ShapesDataset(mel_bins=mel_bins, frames=frames)[0].audio
    assert audio.shape == (mel_bins, frames)
    assert audio.dtype == torch.float32
    assert 0.0 <= audio.min() and audio.max() <= 1.0


def test_spectrogram_sizes_refused():
    with pytest.raises(ValueError, match="mel_bins"):
        ShapesDataset(mel_bins=7)
    with pytest.raises(ValueError, match="frames"):
        ShapesDataset(frames=6)


def test_pitch_says_colour_and_beats_say_shape(train_samples):
    assert len({fundamental_bin(c, 16) for c in COLOURS}) == len(COLOURS)
    for s in train_samples:
        # The fundamental is the loudest bin; the tone is on where that bin stands above the noise.
        assert int(s.audio.mean(dim=1).argmax()) == fundamental_bin(s.colour, 16), s.caption
        on = s.audio[fundamental_bin(s.colour, 16)] > 0.5
        onsets = int(on[0]) + int((on[1:] & ~on[:-1]).sum())
        assert onsets == beats(s.shape), s.caption


# --- fused batches -------------------------------------------------------------------------


def test_vision_only_batch_unchanged(tokenizer):
    """Ids, masks, images and boundary metadata of a vision-only batch, as before audio existed."""
    batch = caption_batch(ShapesDataset(seed=5), list(range(6)), tokenizer, 16, 32)
    assert batch.boundaries.keys() == {VISION}
    digest = hashlib.sha256()
    for t in (batch.input_ids, batch.labels, batch.loss_mask, batch.images(slice(None))):
        digest.update(t.numpy().tobytes())
    digest.update(batch.boundaries[VISION].rows_per_sample.tobytes())
    digest.update(batch.boundaries[VISION].positions.tobytes())
    assert digest.hexdigest() == "1c0ef38ad2941b073075058f93190bc3ac24c2678181fcd2aa329ba7a4d6e616"


def test_audio_follows_the_image(tokenizer):
    patches, clip, seq = 16, 8, 40
    dataset = ShapesDataset(seed=5)
    batch = caption_batch(dataset, [3, 4, 5], tokenizer, patches, seq, tokens_per_clip=clip)
    vision_only = caption_batch(dataset, [3, 4, 5], tokenizer, patches, seq)
    assert batch.boundaries.keys() == {VISION, AUDIO}
    vision, audio = batch.boundaries[VISION], batch.boundaries[AUDIO]
    assert vision.rows_per_sample.tolist() == [patches] * 3 and audio.rows_per_sample.tolist() == [clip] * 3
    assert np.array_equal(vision.positions, np.tile(np.arange(1, 1 + patches), 3))
    assert np.array_equal(audio.positions, np.tile(np.arange(1 + patches, 1 + patches + clip), 3))
    prompt = 1 + patches + clip
    assert (batch.input_ids[:, 1:prompt] == tokenizer.image_id).all()
    # The caption moves by the clip's length; the last audio token predicts its first word.
    assert torch.equal(batch.input_ids[:, prompt:], vision_only.input_ids[:, 1 + patches : seq - clip])
    assert torch.equal(batch.loss_mask[:, prompt - 1 :], vision_only.loss_mask[:, patches : seq - clip])
    assert batch.loss_mask.sum() == vision_only.loss_mask.sum()
    assert torch.equal(batch.audio(slice(1, 3)), torch.stack([dataset[4].audio, dataset[5].audio]))
    with pytest.raises(ValueError, match="--seq-length"):
        caption_batch(dataset, [3], tokenizer, patches, 32, tokens_per_clip=clip)


# --- tokenizer -----------------------------------------------------------------------------


def test_special_ids(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    assert tokenizer.image_id == 4
    caption_words = {word for caption in all_captions() for word in caption.split()}
    assert tokenizer.vocab_size == 5 + len(caption_words) == 22


def test_each_caption_word_is_one_token(tokenizer):
    caption_words = {word for caption in all_captions() for word in caption.split()}
    assert IMAGE_WORDS <= caption_words
    ids = {}
    for word in caption_words:
        (ids[word],) = tokenizer.encode(word)
        assert ids[word] > tokenizer.image_id
    assert len(set(ids.values())) == len(caption_words)


def test_round_trip_every_caption(tokenizer):
    captions = all_captions()
    assert len(captions) == len(COLOURS) * len(SHAPES) * len(POSITIONS)
    for caption in captions:
        ids = tokenizer.encode(caption)
        assert len(ids) == len(caption.split())
        assert tokenizer.unk_id not in ids
        assert tokenizer.decode(ids) == caption


def test_decode_stops_at_eos_and_skips_specials(tokenizer):
    caption = "a purple cross in the bottom left"
    ids = tokenizer.encode(caption)
    framed = [tokenizer.image_id] * 3 + [tokenizer.bos_id] + ids + [tokenizer.eos_id] + tokenizer.encode("a red")
    assert tokenizer.decode(framed + [tokenizer.pad_id] * 4) == caption
    assert tokenizer.decode(torch.tensor(framed)) == caption


def test_text_cannot_produce_image_token(tokenizer):
    assert tokenizer.image_id not in tokenizer.encode("<image> a red circle")
    assert tokenizer.encode("zebra") == [tokenizer.unk_id]


def test_shipped_model_matches_build_script():
    spec = importlib.util.spec_from_file_location("build_tokenizer", REPO_ROOT / "tools" / "build_tokenizer.py")
    build_tokenizer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_tokenizer)
    rebuilt = spm.SentencePieceProcessor(model_proto=build_tokenizer.build_model_bytes())
    shipped = spm.SentencePieceProcessor(model_file=str(DEFAULT_MODEL_PATH))
    assert [rebuilt.id_to_piece(i) for i in range(rebuilt.vocab_size())] == [
        shipped.id_to_piece(i) for i in range(shipped.vocab_size())
    ]
    # A few KB at most: the identity normalizer keeps the NFKC table out of the file.
    assert DEFAULT_MODEL_PATH.stat().st_size < 4096
