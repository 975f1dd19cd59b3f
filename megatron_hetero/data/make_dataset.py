"""A conversation dataset on disk from the shapes generator (tools/make_dataset.py): PNG files and a
LLaVA-style JSON (or JSONL) file, as data/conversations.py reads them.

A sample with k images (min_images..max_images) is k turns: the user sends `<image>`, the assistant
answers its caption. A text-only sample (probability text_only) asks the assistant to repeat a caption.
Which samples have how many images is drawn from `seed`, each image is shapes sample j of the split,
so the files are a pure function of the arguments.
"""

import json
from pathlib import Path

import numpy as np
from PIL import Image

from megatron_hetero.data.shapes import ShapesDataset
from megatron_hetero.data.tokenizer import IMAGE_TOKEN

DATA_FILE = "conversations"  # .json or .jsonl in the output directory; images under images/


def write_png(image, path: Path) -> None:
    """A [3, H, W] image in [0, 1] as an 8-bit RGB PNG."""
    pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(pixels).save(path)


def write_conversations(out_dir, num_samples: int, seed: int = 1234, split: str = "train", image_size: int = 32,
                        max_images: int = 1, text_only: float = 0.0, jsonl: bool = False,
                        min_images: int = 1) -> Path:
    """Write the dataset under out_dir; returns the path of its JSON file."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    shapes, rng = ShapesDataset(seed, split, image_size), np.random.default_rng(seed)
    records, j = [], 0
    for n in range(num_samples):
        if rng.random() < text_only:
            caption = shapes[j].caption
            turns = [("human", f"{caption}"), ("gpt", caption)]
            record = {"id": f"{split}-{n}"}
            j += 1
        else:
            names = []
            turns = []
            for _ in range(rng.integers(min_images, max_images + 1)):
                sample, name = shapes[j], f"images/{split}-{j:07d}.png"
                write_png(sample.image, out / name)
                names.append(name)
                turns += [("human", IMAGE_TOKEN), ("gpt", sample.caption)]
                j += 1
            record = {"id": f"{split}-{n}", "image": names[0] if len(names) == 1 else names}
        record["conversations"] = [{"from": who, "value": text} for who, text in turns]
        records.append(record)
    path = out / f"{DATA_FILE}.{'jsonl' if jsonl else 'json'}"
    with open(path, "w", encoding="utf-8") as f:
        lines = [json.dumps(r) for r in records]
        f.write("\n".join(lines) + "\n" if jsonl else "[\n" + ",\n".join(lines) + "\n]\n")
    return path
