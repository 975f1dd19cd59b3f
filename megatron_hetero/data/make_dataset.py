"""A conversation dataset on disk from the shapes generator (tools/make_dataset.py): PNG files and a
LLaVA-style JSON (or JSONL) file, as data/conversations.py reads them.

A sample with k images (min_images..max_images) is k turns: the user sends `<image>`, the assistant
answers its caption. A text-only sample (probability text_only) asks the assistant to repeat a caption.
Which samples have how many images is drawn from `seed`, each image is shapes sample j of the split,
so the files are a pure function of the arguments.
"""

import contextlib
import io
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


ENERGON_DIR = "energon"  # the energon dataset's directory in the output directory


def write_energon(json_path, out_dir, samples_per_shard: int = 1000) -> Path:
    """A conversation JSON / JSONL file (data/conversations.py: LLaVA or ShareGPT records) and its
    media as a megatron-energon dataset under out_dir: WebDataset tar shards, one sample per record
    (key: its index), parts `json` (the record, its media lists naming the sample's own parts) and
    the media files' bytes, their extensions kept (`0.png`, `1.png`, ... for images; `video0.mp4`, or
    `video0_0.png`, `video0_1.png`, ... for a video's frames); then `energon prepare` (all samples in
    the train split). A media file that is missing is left out of its sample (the loader skips that
    sample, as it does from the JSON). Returns the dataset's directory."""
    import tarfile
    import time

    from megatron_hetero.data.conversations import read_records

    json_path, out = Path(json_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(str(json_path))
    shard = None
    for n, record in enumerate(records):
        if n % samples_per_shard == 0:
            if shard:
                shard.close()
            shard = tarfile.open(out / f"shard-{n // samples_per_shard:05d}.tar", "w")
        record, parts = _media_parts(record, json_path.parent) if isinstance(record, dict) else (record, {})
        parts["json"] = json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogateescape")
        for part, data in parts.items():
            info = tarfile.TarInfo(f"{n:08d}.{part}")
            info.size, info.mtime = len(data), int(time.time())
            shard.addfile(info, io.BytesIO(data))
    if shard:
        shard.close()
    prepare_energon(out)
    return out


def _media_parts(record: dict, root: Path) -> tuple[dict, dict]:
    """The record with its media lists renamed to its parts (see write_energon), and those parts."""
    from megatron_hetero.data.conversations import MEDIA

    parts, record = {}, dict(record)
    for kind, (_, keys) in MEDIA.items():
        key = next((k for k in keys if record.get(k)), None)
        if key is None:
            continue
        value = [record[key]] if isinstance(record[key], str) else record[key]
        prefix = "" if kind == "image" else kind
        names = [[f"{prefix}{i}_{k}{Path(f).suffix}" for k, f in enumerate(v)] if isinstance(v, list) else
                 f"{prefix}{i}{Path(v).suffix}" for i, v in enumerate(value)]
        for name, source in zip(_flat(names), _flat(value)):
            if (root / source).exists():
                parts[name] = (root / source).read_bytes()
        record[key] = names
    return record, parts


def _flat(values: list) -> list:
    return [v for value in values for v in (value if isinstance(value, list) else [value])]


def prepare_energon(directory) -> None:
    """energon's own `energon prepare DIR` on a directory of tar shards, without its questions: every
    sample in the train split, samples as CrudeWebdataset (what our loader reads needs no field map)."""
    from megatron.energon.tools.prepare import command as energon_prepare

    with contextlib.redirect_stdout(io.StringIO()):  # its report previews a sample
        energon_prepare.main([str(directory), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
                              "CrudeWebdataset", "--no-progress", "--num-workers", "1", "--force-overwrite"],
                             standalone_mode=False)
