"""megatron-energon datasets (WebDataset tar shards prepared with `energon prepare`, the format
Megatron-LM's multimodal examples read) as conversation records.

A sample holds a `json` part, the LLaVA-style record (data/conversations.py) whose "image" names
the sample's own image parts, and those parts (`0.png`, `1.png`, ...; data/make_dataset.py's
write_energon converts a LLaVA JSON file to this). A `json` part that is the conversation list
itself, the image a part of its own (`jpg`, ...), as Megatron-LM's
examples/multimodal/convert_llava_pretrain_to_wds.py writes LLaVA-Pretrain, reads too. Samples are
read by index through energon's own
indexed tar reader (the `.tar.idx` files `energon prepare` writes), so that every rank reads the
global microbatches Megatron's sampler asks for, and the data position is Megatron's consumed
samples, saved in its checkpoints.
"""

import os
from pathlib import Path

from megatron_hetero.data.bad_data import BadSample, DataError

META = ".nv-meta"  # what `energon prepare` adds to a dataset directory
IMAGE_PARTS = ("jpg", "jpeg", "png", "webp", "bmp")  # image parts by extension, where the record does not name them


def is_energon_dataset(path: str) -> bool:
    return os.path.isdir(os.path.join(path, META))


class ImagePart:
    """An image part of a sample: its bytes, and a name for messages."""

    def __init__(self, name: str, data: bytes):
        self.name, self.data = name, data

    def __str__(self) -> str:
        return self.name


class EnergonRecords:
    """The records of an energon dataset's split, by index: the `json` part decoded (with surrogate
    escapes, so that a sample with bytes that are not UTF-8 is skipped alone), a BadSample where it
    is not JSON. `image(record, name)` is the sample's image part `name`."""

    def __init__(self, path: str, split: str = "train"):
        try:
            from megatron.energon.epathlib import EPath
            from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta
        except ImportError:
            raise DataError(f"--data-path {path} is a megatron-energon dataset; install megatron-energon "
                            f"(pip install megatron-hetero[energon])") from None
        try:
            self.shards = WebdatasetMeta.from_config(EPath(path), split_part=split).shards
        except (OSError, AssertionError, ValueError) as error:
            raise DataError(f"--data-path {path}: not a prepared energon dataset with a {split} split "
                            f"({error}); run `energon prepare {path}`") from None
        self.path, self._reader, self._pid = path, None, None
        self._length = sum(shard.count for shard in self.shards)

    def _tar_reader(self):
        """energon's reader, opened in each process (DataLoader workers do not share file offsets)."""
        if self._pid != os.getpid():
            from megatron.energon.epathlib import EPath
            from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader

            self._reader, self._pid = ShardInfosITarReader(EPath(self.path), self.shards), os.getpid()
        return self._reader

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int):
        import json

        sample = self._tar_reader()[index]
        where = f"{sample['__shard__']}:{sample['__key__']}"
        if "json" not in sample:
            return BadSample("malformed", self.path, where, "no json part")
        try:
            record = json.loads(sample["json"].decode("utf-8", "surrogateescape"))
        except json.JSONDecodeError as error:
            return BadSample("malformed", self.path, where, f"json part is not JSON ({error.msg})")
        parts = {k: v for k, v in sample.items() if isinstance(v, bytes)}
        if isinstance(record, list):  # the conversations alone (Megatron-LM's LLaVA-Pretrain conversion)
            images = sorted((k for k in parts if k.rsplit(".", 1)[-1].lower() in IMAGE_PARTS),
                            key=lambda k: (len(k), k))
            record = {"conversations": record, **({"image": images} if images else {})}
        if isinstance(record, dict):
            record["__parts__"], record["__where__"] = parts, where
        return record

    def image(self, record: dict, name: str):
        """The part `name` of the record's sample, an image, a video or a frame (a path that does not
        exist where the sample lacks it: it reads as a missing file)."""
        label = f"{self.path}/{record['__where__']}.{name}"
        data = record["__parts__"].get(name)
        return Path(label) if data is None else ImagePart(label, data)
