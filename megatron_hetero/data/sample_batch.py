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
from megatron_hetero.models.kinds import DOCUMENTS_KEY, counts_key, positions_key


@dataclass
class Media:
    items: torch.Tensor  # [n, ...]
    counts: torch.Tensor  # [B] int64, items per sample
    positions: torch.Tensor  # [n x rows per item] int64

    @staticmethod
    def cat(parts: list["Media"]) -> "Media":
        return Media(torch.cat([p.items for p in parts]), torch.cat([p.counts for p in parts]),
                     torch.cat([p.positions for p in parts]))


@dataclass
class Sample:
    input_ids: torch.Tensor  # [S]
    labels: torch.Tensor  # [S]
    loss_mask: torch.Tensor  # [S]
    media: dict[str, Media]  # kind name -> this sample's items (counts [1])
    skipped: list[BadSample] = field(default_factory=list)  # bad samples passed over to reach this one
    documents: torch.Tensor | None = None  # [S] packed: the sample each token belongs to


@dataclass
class SampleBatch:
    input_ids: torch.Tensor  # [B, S]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    media: dict[str, Media]
    skipped: list[BadSample]
    documents: torch.Tensor | None = None  # [B, S] packed

    @staticmethod
    def collate(samples: list[Sample]) -> "SampleBatch":
        documents = None if samples[0].documents is None else torch.stack([s.documents for s in samples])
        return SampleBatch(*(torch.stack([getattr(s, key) for s in samples])
                             for key in ("input_ids", "labels", "loss_mask")),
                           {kind: Media.cat([s.media[kind] for s in samples]) for kind in samples[0].media},
                           [bad for s in samples for bad in s.skipped], documents)

    def model_kwargs(self, input_keys: dict[str, str]) -> dict:
        """The model call's arguments (its keys: models/kinds.py); input_keys: kind name -> its argument.
        Per kind, ragged over the samples: every item `<input key>` [n, ...], the items per sample
        `<kind>_counts` [B] and the positions their rows fill `<kind>_positions` [n x rows per item]."""
        out = dict(input_ids=self.input_ids, labels=self.labels, loss_mask=self.loss_mask)
        for kind, media in self.media.items():
            out[input_keys[kind]] = media.items
            out[counts_key(kind)] = media.counts
            out[positions_key(kind)] = media.positions
        if self.documents is not None:
            out[DOCUMENTS_KEY] = self.documents
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
        media = {kind: Media(torch.cat([s.media[kind].items for s in group]),
                             torch.stack([s.media[kind].counts.sum() for s in group]).sum().reshape(1),
                             torch.cat([s.media[kind].positions + at for s, at in zip(group, offsets)]))
                 for kind in group[0].media}
        packed.append(Sample(input_ids, labels, loss_mask, media, [b for s in group for b in s.skipped], documents))
    return packed
