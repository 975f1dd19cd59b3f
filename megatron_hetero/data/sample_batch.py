"""The data a global microbatch holds, in one place: what loaders produce per sample (`Sample`), how
samples are batched (`SampleBatch.collate`) and the model call's arguments (`SampleBatch.model_kwargs`).

Per sample: the fused sequence's `input_ids`, `labels`, `loss_mask` [S], and for each encoder kind
its `Media`: any number of items (images or their tiles, clips; zero for a sample without that
medium), ragged over the batch: every item of the batch in sample order [n, ...], the items per
sample [B], and the sequence positions the items' rows fill, in item order [n x rows per item].
"""

from dataclasses import dataclass, field

import torch

from megatron_hetero.data.bad_data import BadSample


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


@dataclass
class SampleBatch:
    input_ids: torch.Tensor  # [B, S]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    media: dict[str, Media]
    skipped: list[BadSample]

    @staticmethod
    def collate(samples: list[Sample]) -> "SampleBatch":
        return SampleBatch(*(torch.stack([getattr(s, key) for s in samples])
                             for key in ("input_ids", "labels", "loss_mask")),
                           {kind: Media.cat([s.media[kind] for s in samples]) for kind in samples[0].media},
                           [bad for s in samples for bad in s.skipped])

    def model_kwargs(self, input_keys: dict[str, str]) -> dict:
        """The model call's arguments (models/vlm_parts.py); input_keys: kind name -> its argument.
        Per kind, ragged over the samples: every item `<input key>` [n, ...], the items per sample
        `<kind>_counts` [B] and the positions their rows fill `<kind>_positions` [n x rows per item]."""
        out = dict(input_ids=self.input_ids, labels=self.labels, loss_mask=self.loss_mask)
        for kind, media in self.media.items():
            out[input_keys[kind]] = media.items
            out[counts_key(kind)] = media.counts
            out[positions_key(kind)] = media.positions
        return out


def counts_key(kind: str) -> str:
    """The model call's argument holding a kind's items per sample."""
    return f"{kind}_counts"


def positions_key(kind: str) -> str:
    """The model call's argument holding the sequence positions of a kind's rows."""
    return f"{kind}_positions"
