"""Tiny whole-VLM Hugging Face directories for the family tests, built offline: random weights (every
one, norms and biases included), a word-level tokenizer with the family's special tokens and a chat
template in its style, the image processor's settings, and LLaVA-style conversation data with
images of several sizes (one over the processor's max pixels), a text-only sample and bad images."""

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

WORDS = ("system user assistant You are a helpful . describe the image compare these two images what is in "
         "it red green blue square circle triangle on left right and a picture of shapes text only question "
         "answer yes no").split()


@torch.no_grad()
def randomize(model, seed: int = 1):
    """Every weight random (transformers initializes norms to 1 and biases to 0, which would hide a
    misplaced norm or bias): matrices ~ N(0, 1/fan_in), norm weights and layer scales (InternViT's
    lambdas) 1 + N(0, 0.1^2), other vectors N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() > 1:
            p.copy_(noise * p[0].numel() ** -0.5)
        else:
            p.copy_(any(n in name for n in ("norm", "ln_q", "lambda")) + 0.1 * noise)
    return model


def word_tokenizer(directory: Path, specials: list[str], template: str, eos: str, pad: str, **kwargs):
    """A word-level transformers tokenizer over WORDS and `specials` (ids in that order after <unk>);
    kwargs: further PreTrainedTokenizerFast arguments (e.g. extra_special_tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", *specials, *WORDS])}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token=eos, pad_token=pad,
                                  additional_special_tokens=specials, **kwargs)
    tok.chat_template = template
    tok.save_pretrained(directory)
    return tok


# ---- Qwen2.5-VL --------------------------------------------------------------------------------
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
# Qwen2's chat template (a default system turn), on string contents.
QWEN_TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
                 "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
                 "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PATCH, MERGE, MIN_PIXELS, MAX_PIXELS = 4, 2, 8 * 8, 40 * 40


def qwen2_5_vl_config(tok, tied: bool = False, text_layers: int = 2, vision_layers: int = 3):
    from transformers import Qwen2_5_VLConfig

    ids = tok.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=text_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok) + 5, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
                         bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>")),
        vision_config=dict(depth=vision_layers, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=tied)


def qwen2_5_vl_dir(directory: Path, tied: bool = False, **sizes) -> Path:
    """A tiny Qwen2.5-VL model directory as save_pretrained writes it (the Hub's key names), with its
    tokenizer, chat template and image processor."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = word_tokenizer(directory, QWEN_SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    torch.manual_seed(0)
    model = randomize(Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config(tok, tied, **sizes)).eval())
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                             merge_size=MERGE).save_pretrained(directory)
    return directory


# ---- conversation data -------------------------------------------------------------------------
IMAGE_SIZES = {"wide.png": (48, 24), "tall.png": (20, 36), "square.png": (32, 32), "big.png": (96, 80)}


def _image(path: Path, size: tuple[int, int], seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def conversations(directory: Path, bad: bool = True) -> Path:
    """conversations.json under `directory` with its images: images of different sizes per sample
    (two in one), a text-only sample, one over max pixels; with `bad`, a corrupt and a missing image."""
    directory.mkdir(parents=True, exist_ok=True)
    for seed, (name, size) in enumerate(IMAGE_SIZES.items()):
        _image(directory / name, size, seed)
    (directory / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")

    def turn(user, answer, images=()):
        return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}],
                **({"image": list(images)} if images else {})}

    records = [
        turn("<image>\ncompare these two images <image>", "a red square on the left and a blue circle",
             ["wide.png", "tall.png"]),
        turn("what is in it ?", "text only answer"),
        turn("<image>\ndescribe the image", "a picture of shapes", ["big.png"]),
        turn("describe <image> the image", "green triangle on the right", ["square.png"]),
    ]
    if bad:
        records[2:2] = [turn("<image> describe", "red", ["corrupt.png"]), turn("<image> what", "blue", ["gone.png"])]
    records.append(turn("question <image> and <image>", "yes and no", ["tall.png", "square.png"]))
    for i, record in enumerate(records):
        record["id"] = f"s{i}"
    path = directory / "conversations.json"
    path.write_text(json.dumps(records, indent=1))
    return path


# ---- video data ----------------------------------------------------------------------------------
# The video processors' settings of the tiny models (transformers' names): frames sampled at 2 fps,
# at most 6, each within the image bounds (Qwen2.5-VL) or all within 5x them (Qwen3-VL).
VIDEO_SETTINGS = {
    "qwen2_5_vl": dict(do_sample_frames=True, fps=2, min_frames=4, max_frames=6, patch_size=PATCH, merge_size=MERGE,
                       temporal_patch_size=2, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}),
    "qwen3_vl": dict(do_sample_frames=True, fps=2, min_frames=4, max_frames=6, patch_size=PATCH, merge_size=MERGE,
                     temporal_patch_size=2, size={"shortest_edge": MIN_PIXELS, "longest_edge": 5 * MAX_PIXELS}),
}
# name -> (frames, fps, (width, height)): a clip, and one longer than the frame limit
VIDEO_FILES = {"clip.mp4": (10, 4, (40, 24)), "long.mp4": (40, 10, (24, 32))}


def write_video(path: Path, frames: int, fps: int, size: tuple[int, int], seed: int = 0) -> None:
    """An MPEG-4 video of random frames, encoded with PyAV."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def save_video_settings(directory: Path, family: str) -> None:
    (directory / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_SETTINGS[family], indent=1))


def llava(user: str, answer: str, **media) -> dict:
    """A LLaVA-style record of one exchange."""
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}], **media}


def sharegpt(user: str, answer: str, **media) -> dict:
    """A ShareGPT-style record of one exchange."""
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], **media}


def write_records(records: list[dict], path: Path, prefix: str) -> Path:
    """The records, their ids `prefix`0, `prefix`1, ..., as a JSON file."""
    for i, record in enumerate(records):
        record["id"] = f"{prefix}{i}"
    path.write_text(json.dumps(records, indent=1))
    return path


def video_conversations(directory: Path, bad: bool = True) -> Path:
    """video.json under `directory` (with conversations()'s images): a video without an image
    (LLaVA-style), an image and a video in one sample (ShareGPT-style messages and media lists), a
    video as a list of frame images, an image alone, a video longer than the frame limit; with
    `bad`, a zero-length, a corrupt and a missing video, tags and videos differing in number, and
    audio (which these models do not take)."""
    conversations(directory, bad=False)
    for seed, (name, (frames, fps, size)) in enumerate(VIDEO_FILES.items()):
        write_video(directory / name, frames, fps, size, seed)
    (directory / "frames").mkdir(exist_ok=True)
    for k in range(3):
        _image(directory / "frames" / f"{k}.png", (32, 24), 10 + k)
    (directory / "empty.mp4").write_bytes(b"")
    (directory / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video at all")

    records = [
        llava("<video>\ndescribe the image", "a red square on the left", video="clip.mp4"),
        sharegpt("compare these two images <image> and <video>", "a blue circle", images=["wide.png"],
                 videos=["clip.mp4"]),
        sharegpt("<video> what is in it ?", "green triangle", videos=[[f"frames/{k}.png" for k in range(3)]]),
        llava("<image>\ndescribe", "a picture of shapes", image="square.png"),
        sharegpt("what is in it <video>", "shapes on the right", videos=["long.mp4"]),
    ]
    if bad:
        records[1:1] = [llava("<video> describe", "red", video="empty.mp4"),
                        llava("<video> describe", "red", video="corrupt.mp4"),
                        sharegpt("<video>", "blue", videos=["gone.mp4"]),
                        sharegpt("<video> and <video>", "no", videos=["clip.mp4"]),
                        sharegpt("<audio> what", "yes", audios=["a.wav"])]
    return write_records(records, directory / "video.json", "v")
