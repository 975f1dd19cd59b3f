"""Conversation data: a JSON list (or JSONL, one sample a line) of LLaVA-style records

    {"id": ..., "image": "a.png" | ["a.png", ...] | absent, "video": "v.mp4" | [...] | absent,
     "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}, ...]}

or ShareGPT-style ones (the convention LLaMA-Factory and ms-swift use)

    {"messages": [{"role": "user", "content": "<video>..."}, {"role": "assistant", "content": "..."}],
     "images": [...], "videos": [...], "audios": [...]}

with media paths relative to an image root (a video: a file, or a list of its frames' images), or
the same records in a megatron-energon dataset (data/energon.py). The k-th `<image>` tag is the k-th
image, the k-th `<video>` the k-th video. Each sample becomes a fused sequence (chat.py: the loss on
the assistant's tokens, each tag expanded to its item's rows) and its media's encoder items
(images.py, video.py), in the order of their tags. A bad sample (bad_data.REASONS) is passed over to
the next usable one.
"""

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_hetero.boundary import assign_items
from megatron_hetero.data.audio import AudioError
from megatron_hetero.data.bad_data import BadSample, DataError, SkipReport
from megatron_hetero.data.chat import MEDIA_TAGS, ROLES, Turn, encode_conversation
from megatron_hetero.data.energon import EnergonRecords, ImagePart, is_energon_dataset
from megatron_hetero.data.images import ImageError, check_image
from megatron_hetero.data.media import ImageItems, ImageProcessing
from megatron_hetero.data.sample_batch import Sample, SampleBatch, pack
from megatron_hetero.data.tokenizer import AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN
from megatron_hetero.data.video import VideoError, probe_video
from megatron_hetero.models.kinds import ENCODER_KINDS

VISION, AUDIO = "vision", "audio"  # the encoder kinds whose items these samples carry (images and videos; audios)
# Media kind -> (its tag, the record's keys for its list: LLaVA's, ShareGPT's).
MEDIA = {"image": (IMAGE_TOKEN, ("image", "images")), "video": (VIDEO_TOKEN, ("video", "videos")),
         "audio": (AUDIO_TOKEN, ("audio", "audios"))}
TAG_KIND = {tag: kind for kind, (tag, _) in MEDIA.items()}


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


def _media_lists(record: dict, bad) -> dict[str, list]:
    """kind -> the record's list of that medium (a video: a path, or a list of its frames' paths)."""
    lists = {}
    for kind, (_, keys) in MEDIA.items():
        value = next((record[k] for k in keys if record.get(k) is not None), [])
        value = [value] if isinstance(value, str) else value
        frames = kind == "video"
        if not isinstance(value, list) or not all(isinstance(v, str) or (frames and isinstance(v, list) and v and all(
                isinstance(f, str) for f in v)) for v in value):
            raise bad("malformed", f'"{keys[0]}" is not a path or a list of paths'
                      + (" (or of lists of frame paths)" if frames else ""))
        lists[kind] = value
    return lists


def _turns(record: dict, bad) -> list[Turn]:
    """The record's turns: LLaVA's "conversations" ({"from", "value"}) or ShareGPT's "messages"
    ({"role", "content"})."""
    conversation = record.get("conversations", record.get("messages"))
    if not isinstance(conversation, list) or not all(
            isinstance(t, dict) and isinstance(t.get("value", t.get("content")), str)
            and t.get("from", t.get("role")) in ROLES for t in conversation):
        raise bad("malformed", f'"conversations" is not a list of {{"from": {"|".join(ROLES)}, "value": text}} '
                               f'(nor "messages" a list of {{"role", "content"}})')
    return [Turn(ROLES[t.get("from", t.get("role"))], t.get("value", t.get("content"))) for t in conversation]


def _parse(record, path: str, index: int, kinds: tuple[str, ...]) -> tuple[str, list[tuple[str, object]], list[Turn]]:
    """(sample id, its media as (kind, path or frame paths) in the order of their tags, turns) of a
    record whose media kinds the model takes are `kinds`; raises SkipSample."""
    if isinstance(record, BadSample):
        raise SkipSample(record)
    sample = str(record.get("id", index)) if isinstance(record, dict) else str(index)

    def bad(reason, detail):
        return SkipSample(BadSample(reason, path, sample, detail))

    if not isinstance(record, dict):
        raise bad("malformed", "not a JSON object")
    if any("\udc80" <= ch <= "\udcff" for s in _strings(record) for ch in s):
        raise bad("non_utf8", "text that is not UTF-8")
    lists, turns = _media_lists(record, bad), _turns(record, bad)
    if not any(t.role == "assistant" and t.text.strip() for t in turns):
        raise bad("empty_conversation", "no assistant text to learn")
    tags = [TAG_KIND[tag] for t in turns for tag in MEDIA_TAGS.findall(t.text)]
    for kind, items in lists.items():
        if (items or kind in tags) and kind not in kinds:
            raise bad("unsupported_media", f"{kind} input, which this model does not take")
        if tags.count(kind) != len(items):
            raise bad(f"{kind}_count_mismatch", f"{tags.count(kind)} {MEDIA[kind][0]} tags for {len(items)} {kind}s")
    remaining = {kind: iter(items) for kind, items in lists.items()}
    return sample, [(kind, next(remaining[kind])) for kind in tags], turns


class JsonRecords(list):
    """A JSON / JSONL file's records; their images and videos are files under the image root."""

    def __init__(self, path: str, image_root: str):
        super().__init__(read_records(path))
        self.root = Path(image_root)

    def image(self, record: dict, name: str) -> Path:
        """The file `name` of a record (an image, a video or a frame)."""
        return self.root / name


def open_records(path: str, image_root: str):
    """--data-path's records: an energon dataset directory, else a JSON / JSONL file."""
    return EnergonRecords(path) if is_energon_dataset(path) else JsonRecords(path, image_root)


def _openable(source):
    """What Pillow and PyAV open: a file's path, or an energon part's bytes (a fresh stream each
    time); a video's frames each so."""
    if isinstance(source, list):
        return [_openable(frame) for frame in source]
    return io.BytesIO(source.data) if isinstance(source, ImagePart) else source


@dataclass(frozen=True)
class MediaSource:
    """A sample's image, video or audio: its kind, its file (a video's frames: their files) and its
    items; `tagged`: it has a tag of its own (a video's own audio track has none: the video's tag
    expands to both)."""

    kind: str
    source: object
    items: ImageItems
    tagged: bool = True


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
    # the same for the audio encoders (a model that takes audio): (dp, dp rank) of each whose first
    # stage this rank holds, the audio encoder's hidden size
    audio_shares: tuple[tuple[int, int], ...] = ((1, 0),)
    audio_width: int = 1
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

    def _items(self, media: list[tuple[str, object]], sample: str) -> list[MediaSource]:
        """Each image's, video's and audio's items, from its size, frames or length (an image or a
        video checked, not decoded); raises SkipSample."""
        sources = []
        for kind, source in media:
            try:
                sources += self._medium(kind, source)
            except (ImageError, VideoError, AudioError) as error:
                reason = f"missing_{kind}" if str(error).startswith(f"missing {kind}") else f"corrupt_{kind}"
                raise SkipSample(BadSample(reason, str(source), sample, str(error))) from None
        return sources

    def _medium(self, kind: str, source) -> list[MediaSource]:
        """A medium's sources: itself, and after a video the audio of its own track where the model
        loads it (`load_audio_from_video`: the video's tag expands to both)."""
        images = self.spec.images
        if kind == "image":
            return [MediaSource(kind, source, images.items(*check_image(_openable(source))))]
        if kind == "audio":
            return [MediaSource(kind, source, images.audio_items(images.audio_info(_openable(source))))]
        items = images.video_items(probe_video(_openable(source)))
        if not getattr(images, "load_audio_from_video", False):
            return [MediaSource(kind, source, items)]
        audio = images.audio_items(images.audio_info(_openable(source)))
        return [MediaSource(kind, source, images.with_audio(items, audio)),
                MediaSource("audio", source, audio, tagged=False)]

    def _kinds(self) -> tuple[str, ...]:
        """The media kinds this model's processing takes (its `media_kinds`; else videos where it has
        video_items)."""
        default = ("image", "video") if hasattr(self.spec.images, "video_items") else ("image",)
        return getattr(self.spec.images, "media_kinds", default)

    def _encoders(self) -> tuple[str, ...]:
        """The encoder kinds of this model's samples: vision, and audio where it takes audio."""
        return (VISION, AUDIO) if "audio" in self._kinds() else (VISION,)

    def encode(self, index: int) -> tuple[Sample, list[MediaSource]]:
        """Record `index` as a sample, and its media (files, frame lists or energon parts, with their
        items); raises SkipSample."""
        spec = self.spec
        record = self.records[index]
        sample, media, turns = _parse(record, spec.path, index, self._kinds())
        sources = self._items([(kind, self._source(record, name)) for kind, name in media], sample)
        expansions = [s.items.expansion if s.items.expansion is not None else sum(s.items.rows)
                      for s in sources if s.tagged]
        ids, assistant = encode_conversation(self.tokenizer, turns, expansions, self.image_tokens)
        if len(ids) > spec.seq_length:
            raise SkipSample(BadSample("too_long", spec.path, sample,
                                       f"{len(ids)} tokens, more than --seq-length {spec.seq_length}"))
        media, vision = self._media(ids, sources, sample)
        at = media[VISION].positions.tolist()
        runs = [t for k, t in enumerate(at) if not k or at[k - 1] != t - 1]  # each run of placeholders' start
        position_ids = spec.images.position_ids(spec.seq_length, runs, vision)
        return Sample(*self._sequence(ids, assistant), media, position_ids=position_ids), sources

    def _media(self, ids: list[int], sources: list[MediaSource], sample: str) -> tuple[dict, list[ImageItems]]:
        """(encoder kind -> the sample's Media, the vision items) from its tokens: each encoder's
        rows fill the positions of its placeholders; raises SkipSample."""
        images = self.spec.images
        kinds = {VISION: (self.image_tokens.placeholders, [s.items for s in sources if s.kind != "audio"])}
        if AUDIO in self._encoders():
            kinds[AUDIO] = ((images.audio_tokens.placeholder,), [s.items for s in sources if s.kind == "audio"])
        media = {}
        for kind, (placeholders, items) in kinds.items():
            at = torch.tensor([t for t, token in enumerate(ids) if token in placeholders], dtype=torch.long)
            if len(at) != sum(sum(i.rows) for i in items):
                raise SkipSample(BadSample("malformed", self.spec.path, sample, "its text holds the model's media "
                                                                                "placeholder tokens"))
            media[kind] = images.media(items, at) if kind == VISION else images.audio_media(items, at)
        return media, kinds[VISION][1]

    def _source(self, record, name):
        """A medium's file (a video as frames: each frame's)."""
        part = self.records.image
        return [part(record, frame) for frame in name] if isinstance(name, list) else part(record, name)

    def _sequence(self, ids: list[int], assistant: list[bool]):
        s, n = self.spec.seq_length, len(ids)
        input_ids = torch.full((s,), self.tokenizer.pad_id, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids, dtype=torch.long)
        labels = torch.full((s,), self.tokenizer.pad_id, dtype=torch.long)
        labels[: n - 1] = input_ids[1:n]
        loss_mask = torch.zeros(s)
        loss_mask[: n - 1] = torch.tensor(assistant[1:], dtype=torch.float)  # position t predicts token t+1
        return input_ids, labels, loss_mask

    def __getitem__(self, index: int) -> tuple[Sample, list[MediaSource]]:
        n, skipped = len(self.records), []
        for step in range(n):
            try:
                sample, sources = self.encode((int(index) + step) % n)
            except SkipSample as skip:
                skipped.append(skip.bad)
                continue
            sample.skipped = skipped
            return sample, sources
        raise DataError(f"--data-path {self.spec.path}: no usable sample (first problem: {skipped[0].line()}); "
                            f"run with --strict-data to stop at each")

    def _decode(self, sample: Sample, sources: list[MediaSource], kind: str = VISION) -> None:
        """The pixels of a sample's images and videos (kind VISION), or its audios' features."""
        images = self.spec.images
        sources = [s for s in sources if (s.kind == "audio") == (kind == AUDIO)]
        try:
            items = [images.pixels(_openable(s.source)) if s.kind == "image" else
                     images.video_pixels(_openable(s.source), s.items) if s.kind == "video" else
                     images.audio_pixels(_openable(s.source), s.items) for s in sources]
        except (ImageError, VideoError, AudioError) as error:  # checked in encode: a file changed or broken past it
            raise DataError(f"{self.spec.path}: cannot decode an image, video or audio of a sample ({error}); "
                            f"fix or remove it") from None
        if items:
            sample.media[kind].items = torch.cat(items)

    def _decode_shares(self, samples: list[tuple[Sample, list]], kind: str, shares, width: int) -> None:
        """Decodes the `kind` media of the samples holding items that the encoder DP ranks `shares`
        ((dp, rank) each) take: the boundary's assignment by the items' tokens (assign_items)."""
        counts = [int(sample.media[kind].counts) for sample, _ in samples]
        owner = np.repeat(np.arange(len(samples)), counts)  # the sample of each item
        media = [sample.media[kind] for sample, _ in samples]
        tokens = np.concatenate([self.spec.images.item_tokens(m) if kind == VISION else m.grids.prod(1).numpy()
                                 for m in media])
        for dp, rank in shares:
            mine = assign_items(tokens, width, dp) == rank
            for s in np.unique(owner[mine]):
                self._decode(*samples[s], kind)

    def collate(self, samples: list[tuple[Sample, list]]) -> dict:
        """The model call's arguments for a global microbatch (this rank's encoder samples decoded),
        and `skipped`: the bad samples passed over."""
        self._decode_shares(samples, VISION, self.spec.decode_shares, self.spec.encoder_width)
        if AUDIO in self._encoders():
            self._decode_shares(samples, AUDIO, self.spec.audio_shares, self.spec.audio_width)
        samples = [sample for sample, _ in samples]
        if self.spec.pack_samples > 1:
            samples = pack(samples, self.spec.pack_samples, self.tokenizer.pad_id)
        batch = SampleBatch.collate(samples)
        return {**batch.model_kwargs({VISION: self.input_key, AUDIO: ENCODER_KINDS[AUDIO].input_key}),
                "skipped": batch.skipped}
