"""LLaVA-style conversation data: a JSON list (or JSONL, one sample a line) of

    {"id": ..., "image": "a.png" | ["a.png", ...] | absent,
     "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}, ...]}

with image paths relative to an image root, or the same records in a megatron-energon dataset
(data/energon.py). Each sample becomes a fused sequence (chat.py: the loss
on the assistant's tokens, each `<image>` tag expanded to its image's rows) and its images' tiles
(images.py). A bad sample (bad_data.REASONS) is passed over to the next usable one.
"""

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_hetero.boundary import assign_items
from megatron_hetero.data.bad_data import BadSample, DataError, SkipReport
from megatron_hetero.data.chat import ROLES, Turn, encode_conversation
from megatron_hetero.data.energon import EnergonRecords, ImagePart, is_energon_dataset
from megatron_hetero.data.images import ImageError, check_image
from megatron_hetero.data.media import ImageItems, ImageProcessing
from megatron_hetero.data.sample_batch import Sample, SampleBatch, pack
from megatron_hetero.data.tokenizer import IMAGE_TOKEN

VISION = "vision"  # the encoder kind whose items these samples carry


class SkipSample(Exception):
    def __init__(self, bad: BadSample):
        self.bad = bad


def read_records(path: str) -> list:
    """The file's samples (dicts), a BadSample for a JSONL line that is not JSON. Text is decoded
    with surrogate escapes, so a sample with bytes that are not UTF-8 can be skipped alone."""
    try:
        text = Path(path).read_bytes().decode("utf-8", "surrogateescape")
    except OSError as error:
        raise DataError(f"--data-path {path}: cannot read it ({error.strerror})") from None
    if path.endswith(".jsonl"):
        records = []
        for n, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    records.append(BadSample("malformed", path, f"at line {n + 1}", f"not JSON ({error.msg})"))
        return records
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"--data-path {path}: not JSON ({error.msg} at line {error.lineno}); "
                            f"give a JSON list of samples, or JSON lines in a .jsonl file") from None
    if not isinstance(records, list):
        raise DataError(f"--data-path {path}: a JSON list of samples expected, got {type(records).__name__}")
    return records


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from (k, *_strings(v))
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _parse(record, path: str, index: int) -> tuple[str, list[str], list[Turn]]:
    """(sample id, image paths, turns) of a record; raises SkipSample."""
    if isinstance(record, BadSample):
        raise SkipSample(record)
    sample = str(record.get("id", index)) if isinstance(record, dict) else str(index)

    def bad(reason, detail):
        return SkipSample(BadSample(reason, path, sample, detail))

    if not isinstance(record, dict):
        raise bad("malformed", "not a JSON object")
    if any("\udc80" <= ch <= "\udcff" for s in _strings(record) for ch in s):
        raise bad("non_utf8", "text that is not UTF-8")
    images = record.get("image", [])
    images = [images] if isinstance(images, str) else images
    conversation = record.get("conversations")
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise bad("malformed", '"image" is not a path or a list of paths')
    if not isinstance(conversation, list) or not all(
            isinstance(t, dict) and isinstance(t.get("value"), str) and t.get("from") in ROLES
            for t in conversation):
        raise bad("malformed", f'"conversations" is not a list of {{"from": {"|".join(ROLES)}, "value": text}}')
    turns = [Turn(ROLES[t["from"]], t["value"]) for t in conversation]
    if not any(t.role == "assistant" and t.text.strip() for t in turns):
        raise bad("empty_conversation", "no assistant text to learn")
    tags = sum(t.text.count(IMAGE_TOKEN) for t in turns)
    if tags != len(images):
        raise bad("image_count_mismatch", f"{tags} {IMAGE_TOKEN} tags for {len(images)} images")
    return sample, images, turns


class JsonRecords(list):
    """A JSON / JSONL file's records; their images are files under the image root."""

    def __init__(self, path: str, image_root: str):
        super().__init__(read_records(path))
        self.root = Path(image_root)

    def image(self, record: dict, name: str) -> Path:
        return self.root / name


def open_records(path: str, image_root: str):
    """--data-path's records: an energon dataset directory, else a JSON / JSONL file."""
    return EnergonRecords(path) if is_energon_dataset(path) else JsonRecords(path, image_root)


def _openable(source):
    """What Pillow opens: a file's path, or an energon image part's bytes (a fresh stream each time)."""
    return io.BytesIO(source.data) if isinstance(source, ImagePart) else source


@dataclass(frozen=True)
class ConversationSpec:
    path: str
    image_root: str
    seq_length: int
    images: ImageProcessing  # what an image becomes (data/media.py: TileImages, or a family's)
    # (dp, dp rank) of each vision encoder whose first stage this rank holds: it decodes the images
    # of the samples holding items (tiles) that DP rank encodes; others stay NaN.
    decode_shares: tuple[tuple[int, int], ...] = ((1, 0),)
    encoder_width: int = 1  # the encoder's hidden size: with the items' tokens, their cost (assign_items)
    pack_samples: int = 1  # samples per sequence (--pack-samples; 1: no packing)


class ConversationSamples(torch.utils.data.Dataset):
    """`num_samples` samples (indices wrap around the file); sample i is the first usable one from
    record i % len(file) on. Samples carry their images' items as NaN until `collate` decodes the
    ones this rank encodes (an item encoded undecoded would make the loss NaN, not wrong)."""

    def __init__(self, spec: ConversationSpec, tokenizer, num_samples: int, input_key: str = "images"):
        self.spec, self.tokenizer, self.num_samples, self.input_key = spec, tokenizer, num_samples, input_key
        self.image_tokens = spec.images.tokens(tokenizer)
        self.records = open_records(spec.path, spec.image_root)
        self.report = SkipReport()  # the training process's count (patches/hetero_data.py fills it)
        if not self.records:
            raise DataError(f"--data-path {spec.path} holds no sample")

    def __len__(self) -> int:
        return self.num_samples

    def _items(self, paths: list, sample: str) -> list[ImageItems]:
        """Each image's items, from its size (its file checked, not decoded); raises SkipSample."""
        items = []
        for path in paths:
            try:
                items.append(self.spec.images.items(*check_image(_openable(path))))
            except ImageError as error:
                reason = "missing_image" if str(error) == "missing image" else "corrupt_image"
                raise SkipSample(BadSample(reason, str(path), sample, str(error))) from None
        return items

    def encode(self, index: int) -> tuple[Sample, list]:
        """Record `index` as a sample, and its images (files or energon parts); raises SkipSample."""
        spec = self.spec
        record = self.records[index]
        sample, images, turns = _parse(record, spec.path, index)
        paths = [self.records.image(record, image) for image in images]
        items = self._items(paths, sample)
        ids, assistant = encode_conversation(self.tokenizer, turns, [sum(i.rows) for i in items], self.image_tokens)
        if len(ids) > spec.seq_length:
            raise SkipSample(BadSample("too_long", spec.path, sample,
                                       f"{len(ids)} tokens, more than --seq-length {spec.seq_length}"))
        at = [t for t, token in enumerate(ids) if token == self.image_tokens.placeholder]
        media = spec.images.media(items, torch.tensor(at, dtype=torch.long))
        starts = np.cumsum([0] + [sum(i.rows) for i in items])[:-1]
        grids = [g for i in items for g in (i.grids or ())]
        position_ids = spec.images.position_ids(spec.seq_length, [at[k] for k in starts], grids)
        return Sample(*self._sequence(ids, assistant), {VISION: media}, position_ids=position_ids), paths

    def _sequence(self, ids: list[int], assistant: list[bool]):
        s, n = self.spec.seq_length, len(ids)
        input_ids = torch.full((s,), self.tokenizer.pad_id, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids, dtype=torch.long)
        labels = torch.full((s,), self.tokenizer.pad_id, dtype=torch.long)
        labels[: n - 1] = input_ids[1:n]
        loss_mask = torch.zeros(s)
        loss_mask[: n - 1] = torch.tensor(assistant[1:], dtype=torch.float)  # position t predicts token t+1
        return input_ids, labels, loss_mask

    def __getitem__(self, index: int) -> tuple[Sample, list]:
        n, skipped = len(self.records), []
        for step in range(n):
            try:
                sample, paths = self.encode((int(index) + step) % n)
            except SkipSample as skip:
                skipped.append(skip.bad)
                continue
            sample.skipped = skipped
            return sample, paths
        raise DataError(f"--data-path {self.spec.path}: no usable sample (first problem: {skipped[0].line()}); "
                            f"run with --strict-data to stop at each")

    def _decode(self, sample: Sample, paths: list) -> None:
        try:
            items = [self.spec.images.pixels(_openable(p)) for p in paths]
        except ImageError as error:  # checked in encode: only a file changed or broken past its structure
            raise DataError(f"{self.spec.path}: cannot decode an image of a sample ({error}); "
                                f"fix or remove it") from None
        if items:
            sample.media[VISION].items = torch.cat(items)

    def collate(self, samples: list[tuple[Sample, list]]) -> dict:
        """The model call's arguments for a global microbatch (this rank's encoder samples decoded),
        and `skipped`: the bad samples passed over."""
        counts = [int(sample.media[VISION].counts) for sample, _ in samples]
        owner = np.repeat(np.arange(len(samples)), counts)  # the sample of each item
        tokens = np.concatenate([self.spec.images.item_tokens(sample.media[VISION]) for sample, _ in samples])
        for dp, rank in self.spec.decode_shares:
            mine = assign_items(tokens, self.spec.encoder_width, dp) == rank
            for s in np.unique(owner[mine]):
                self._decode(*samples[s])
        samples = [sample for sample, _ in samples]
        if self.spec.pack_samples > 1:
            samples = pack(samples, self.spec.pack_samples, self.tokenizer.pad_id)
        batch = SampleBatch.collate(samples)
        return {**batch.model_kwargs({VISION: self.input_key}), "skipped": batch.skipped}
