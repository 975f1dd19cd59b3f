"""The data a global microbatch holds, in one place: what loaders produce per sample (`Sample`), how
samples are batched (`SampleBatch.collate`) and the model call's arguments (`SampleBatch.model_kwargs`).

Per sample: the fused sequence's `input_ids`, `labels`, `loss_mask` [S], and for each encoder kind
its `Media`: any number of items (images or their tiles, clips; zero for a sample without that
medium), ragged over the batch: every item of the batch in sample order [n, ...], the items per
sample [B], and the sequence positions the items' rows fill, in item order [n x rows per item].
With sequence packing (`pack`), a sequence holds several samples back to back and `documents` [S]
says which one each token belongs to.
"""

from dataclasses import dataclass, field

import torch

from megatron_hetero.data.bad_data import BadSample, DataError
from megatron_hetero.models.kinds import DOCUMENTS_KEY, POSITION_IDS_KEY, counts_key, grids_key, positions_key, rows_key


@dataclass
class Media:
    """A kind's items: fixed-size ones [n, ...], or native-resolution ones (`grids` given: item i a
    (t, h, w) grid of patches) as every item's patches back to back [sum of t*h*w, patch values];
    `rows`: the rows each item sends into the sequence, where the model's kind does not say it."""

    items: torch.Tensor  # [n, ...] or [patches, ...]
    counts: torch.Tensor  # [B] int64, items per sample
    positions: torch.Tensor  # [sum of rows] int64
    grids: torch.Tensor | None = None  # [n, 3] int64
    rows: torch.Tensor | None = None  # [n] int64

    @staticmethod
    def cat(parts: list["Media"]) -> "Media":
        return Media(*(None if getattr(parts[0], key) is None else torch.cat([getattr(p, key) for p in parts])
                       for key in ("items", "counts", "positions", "grids", "rows")))


@dataclass
class Sample:
    input_ids: torch.Tensor  # [S]
    labels: torch.Tensor  # [S]
    loss_mask: torch.Tensor  # [S]
    media: dict[str, Media]  # kind name -> this sample's items (counts [1])
    skipped: list[BadSample] = field(default_factory=list)  # bad samples passed over to reach this one
    documents: torch.Tensor | None = None  # [S] packed: the sample each token belongs to
    position_ids: torch.Tensor | None = None  # [3, S] M-RoPE position ids (None: 0..S-1)


@dataclass
class SampleBatch:
    input_ids: torch.Tensor  # [B, S]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    media: dict[str, Media]
    skipped: list[BadSample]
    documents: torch.Tensor | None = None  # [B, S] packed
    position_ids: torch.Tensor | None = None  # [B, 3, S] M-RoPE

    @staticmethod
    def collate(samples: list[Sample]) -> "SampleBatch":
        documents, position_ids = (None if getattr(samples[0], key) is None else
                                   torch.stack([getattr(s, key) for s in samples])
                                   for key in ("documents", "position_ids"))
        return SampleBatch(*(torch.stack([getattr(s, key) for s in samples])
                             for key in ("input_ids", "labels", "loss_mask")),
                           {kind: Media.cat([s.media[kind] for s in samples]) for kind in samples[0].media},
                           [bad for s in samples for bad in s.skipped], documents, position_ids)

    def model_kwargs(self, input_keys: dict[str, str]) -> dict:
        """The model call's arguments (its keys: models/kinds.py); input_keys: kind name -> its argument.
        Per kind, ragged over the samples: every item `<input key>` [n, ...], the items per sample
        `<kind>_counts` [B] and the positions their rows fill `<kind>_positions` [n x rows per item]."""
        out = dict(input_ids=self.input_ids, labels=self.labels, loss_mask=self.loss_mask)
        for kind, media in self.media.items():
            out[input_keys[kind]] = media.items
            out[counts_key(kind)] = media.counts
            out[positions_key(kind)] = media.positions
            if media.grids is not None:
                out[grids_key(kind)] = media.grids
            if media.rows is not None:
                out[rows_key(kind)] = media.rows
        if self.documents is not None:
            out[DOCUMENTS_KEY] = self.documents
        if self.position_ids is not None:
            out[POSITION_IDS_KEY] = self.position_ids
        return out


def pack(samples: list[Sample], per_pack: int, pad_id: int) -> list[Sample]:
    """Sequence packing: each run of `per_pack` samples as one sequence of the same length S, their
    tokens (up to the last that is not `pad_id`) back to back, padding after; each medium's items
    in order, their rows' positions moved by their sample's offset (the boundary fills the packed
    positions); `documents`: the sample of each token (per_pack for the padding), which attention
    keeps apart (models/attention.py). Labels and loss mask stay each sample's own (a sample's last
    token predicts nothing), so a packed batch has the unpacked one's loss tokens."""
    packed = []
    for first in range(0, len(samples), per_pack):
        group, seq = samples[first : first + per_pack], len(samples[first].input_ids)
        lengths = [int((s.input_ids != pad_id).nonzero().max()) + 1 if (s.input_ids != pad_id).any() else 0
                   for s in group]
        if sum(lengths) > seq:
            raise DataError(f"--pack-samples {per_pack}: samples {first}-{first + len(group) - 1} of a global "
                            f"microbatch need {sum(lengths)} tokens together, more than --seq-length {seq}; "
                            f"raise --seq-length or pack fewer samples")
        offsets = [sum(lengths[:j]) for j in range(len(group))]
        input_ids = torch.full((seq,), pad_id, dtype=group[0].input_ids.dtype)
        labels = torch.full((seq,), pad_id, dtype=group[0].labels.dtype)
        loss_mask, documents = torch.zeros(seq), torch.full((seq,), len(group), dtype=torch.long)
        for j, (s, n, at) in enumerate(zip(group, lengths, offsets)):
            input_ids[at : at + n], labels[at : at + n] = s.input_ids[:n], s.labels[:n]
            loss_mask[at : at + n], documents[at : at + n] = s.loss_mask[:n], j
        media = {}
        for kind in group[0].media:
            joined = Media.cat([s.media[kind] for s in group])
            joined.counts = joined.counts.sum().reshape(1)
            joined.positions = torch.cat([s.media[kind].positions + at for s, at in zip(group, offsets)])
            media[kind] = joined
        packed.append(Sample(input_ids, labels, loss_mask, media, [b for s in group for b in s.skipped], documents,
                             _packed_position_ids(group, lengths, seq)))
    return packed


def _packed_position_ids(group: list[Sample], lengths: list[int], seq: int) -> torch.Tensor | None:
    """Each sample's M-RoPE position ids over its tokens, back to back; the padding's count on. A
    document's attention scores depend only on its own positions' differences (attention stays
    within it), so no offset is needed."""
    if group[0].position_ids is None:
        return None
    parts = [s.position_ids[:, :n] for s, n in zip(group, lengths)]
    start, tail = max((int(p.max()) + 1 for p in parts if p.numel()), default=0), seq - sum(lengths)
    return torch.cat([*parts, torch.arange(start, start + tail).expand(3, tail)], 1)
