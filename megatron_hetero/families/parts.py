"""This project's reference multimodal model (models/vlm.py: encoders of the registered kinds and a
GPTModel on our TE-free layers), or a VLM family's (families/: its vision tower, the same LLM), as
per-module parts for megatron.training, and its adapter.

The script calls `model(input_ids=, labels=, loss_mask=, <kind input>=, <kind>_counts=,
<kind>_positions=[, <kind>_grids=, <kind>_rows=][, document_ids=][, position_ids=])` on a global
microbatch (data/sample_batch.py): per sequence, its token ids, labels and loss mask [S] (and with
packing the sample of each token; with M-RoPE the position ids [3, S]); per kind, ragged over the
samples, every item (images [3, H, W], clips [mel, frames]; native-resolution images as their
patches, with each one's grid and rows), the items per sequence and the sequence positions their
rows fill. The LLM takes its data-parallel rank's sequences and its
context-parallel positions (Megatron's load-balanced chunks); an encoder's data-parallel ranks take
the items by cost (boundary.assign_items). On the last LLM stage the model returns (per-token losses
[b, s_local], loss mask [b, s_local]) for the script's loss function.
"""

import numpy as np
import torch

from megatron_hetero.boundary import BoundaryBatch, assign_items, input_rows
from megatron_hetero.families import family_named
from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.models.deepstack import stage_width
from megatron_hetero.models.init import build_stage
from megatron_hetero.models.kinds import (
    DOCUMENTS_KEY,
    POSITION_IDS_KEY,
    counts_key,
    encoder_kind,
    grids_key,
    positions_key,
    rows_key,
)
from megatron_hetero.models.transfer import to_device
from megatron_hetero.models.vlm import build_llm, llm_forward
from megatron_hetero.parallel.context import HeteroRun, ModuleRuntime
from megatron_hetero.runtime.model import ModelCall, ModelParts
from megatron_hetero.spec.sizes import ModelSizes


def build_vlm_parts(run: HeteroRun, sizes: ModelSizes, seed: int, ablate_vision: bool = False,
                    dtype: torch.dtype = torch.float32, packed: bool = False,
                    config_fields: dict | None = None) -> ModelParts:
    """This rank's stage of every module it holds, its weights in `dtype` (`packed`: the LLM sees
    packed sequences, --pack-samples; `config_fields`: TransformerConfig fields every module takes
    from Megatron's flags, training/providers.megatron_config_fields); module i of the layout from
    seed + i, so a module's weights do not depend on what else a rank holds, nor on its TP or PP
    size."""
    fields = config_fields or {}
    parts = {}
    for index, module in enumerate(run.modules.values()):
        if not module.held:
            continue
        layout, pgs = module.layout, module.groups.layer_groups()
        if layout.role == "llm":
            def build(whole, layout=layout, module=module):
                pgs = module.groups.all_experts_here() if whole else module.pgs
                return build_llm(sizes, layout.tp, pgs, dtype, whole=whole, sp=layout.sp, packed=packed, **fields)
        else:
            def build(whole, layout=layout, pgs=pgs):
                return encoder_builder(layout, sizes)(sizes, layout.tp, pgs, dtype, whole=whole, **fields)
        parts[module.name] = build_stage(build, seed + index, layout.pp, ep=layout.ep)
    return ModelParts(parts, VLMAdapter(run, sizes, ablate_vision, dtype))


def encoder_builder(layout, sizes: ModelSizes):
    """The builder of an encoder module: a VLM family's vision tower or audio encoder, else its kind's."""
    kind = encoder_kind(layout)
    if sizes.family and kind.name == "vision":
        return family_named(sizes.family).build_vision
    if sizes.family and kind.name == "audio":
        return family_named(sizes.family).build_audio
    return kind.build


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class VLMAdapter:
    def __init__(self, run: HeteroRun, sizes: ModelSizes, ablate_vision: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.run, self.sizes, self.ablate_vision, self.dtype = run, sizes, ablate_vision, dtype
        # A family's DeepStack blocks: extra columns of the vision rows, for LLM layers 0..k-1
        self.deepstack = len(family_named(sizes.family).deepstack(sizes)) if sizes.family else 0

    def batch_size(self, call: ModelCall) -> int:
        return call.kwargs["input_ids"].shape[0]

    def boundary_like(self) -> torch.Tensor:
        return torch.zeros(0, self.sizes.hidden_size * (1 + self.deepstack), dtype=self.dtype, device=_device())

    def _llm_seq_local(self) -> int:
        llm = self.run.layout.llm
        return self.sizes.seq_length // llm.cp // (llm.tp if llm.sp else 1)

    def stage_hidden_like(self, module: ModuleRuntime, call: ModelCall, share,
                          stage: int | None = None) -> torch.Tensor:
        if module.layout.role == "llm":  # with DeepStack blocks still to add (models/deepstack.py)
            stage = module.coords()["pp"] if stage is None else stage
            blocks = stage_width(self.deepstack, self.sizes.num_layers, module.layout.pp, stage)
            shape = (self._llm_seq_local(), share.stop - share.start, self.sizes.hidden_size * blocks)
        else:
            kind = encoder_kind(module.layout)
            tokens = kind.stage_tokens(self.sizes) // module.layout.sequence_cp  # its CP part of an item
            shape = (tokens, len(share), kind.hidden_size(self.sizes))
        return torch.empty(shape, dtype=self.dtype, device=_device())

    def _item_shapes(self, kind, call: ModelCall) -> tuple[np.ndarray, np.ndarray]:
        """(rows each item sends into the sequence, tokens it runs through the encoder) [items]: the
        batch's where it has them (`<kind>_rows`; native-resolution items' grids), else the kind's."""
        items = int(call.kwargs[counts_key(kind.name)].sum())
        rows, grids = call.kwargs.get(rows_key(kind.name)), call.kwargs.get(grids_key(kind.name))
        rows = np.full(items, kind.tokens_per_item(self.sizes)) if rows is None else rows.cpu().numpy()
        tokens = np.full(items, kind.stage_tokens(self.sizes)) if grids is None else grids.prod(1).cpu().numpy()
        return rows, tokens

    def boundary_batches(self, name: str, calls: list[ModelCall]) -> list[BoundaryBatch]:
        """Each item's rows; the calls' items go to the encoder's DP ranks by the cost of their
        tokens (all alike for fixed-size items: round robin)."""
        module = self.run.layout.module(name)
        kind = encoder_kind(module)
        shapes = [self._item_shapes(kind, call) for call in calls]
        tokens = np.concatenate([tokens for _, tokens in shapes])
        item_dp = assign_items(tokens, kind.hidden_size(self.sizes), module.dp)
        per_call = np.split(item_dp, np.cumsum([len(rows) for rows, _ in shapes])[:-1])
        return [self._boundary_batch(kind, call, rows, dp) for call, (rows, _), dp in zip(calls, shapes, per_call)]

    def _boundary_batch(self, kind, call: ModelCall, rows: np.ndarray, item_dp: np.ndarray) -> BoundaryBatch:
        counts = call.kwargs[counts_key(kind.name)].cpu().numpy()
        per_sample = np.bincount(np.repeat(np.arange(len(counts)), counts), rows, len(counts)).astype(np.int64)
        return BoundaryBatch(per_sample, call.kwargs[positions_key(kind.name)].cpu().numpy(),
                             call.kwargs["input_ids"].shape[1], rows, item_dp)

    def _selected(self, inputs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """inputs[index] on this rank's device in the model's dtype, cast and selected there: the
        whole host tensor goes over as it is (pinned by megatron.training's loader, so the copy does
        not hold the host), cast before the selection (the same values; the full-width copy is freed
        first). Selecting on the host made a pageable copy, and a blocking .to(device, dtype) casts
        on the CPU: the GPU waited for both, every microbatch."""
        device = _device()
        return inputs.to(device, non_blocking=True).to(self.dtype)[to_device([index], device)[0]]

    def _encoder_inputs(self, kind, call: ModelCall, items: torch.Tensor) -> tuple:
        """The first stage's arguments for `items`: their tensors (a native-resolution item's patches),
        and their grids where the items have them."""
        inputs, grids = call.kwargs[kind.input_key], call.kwargs.get(grids_key(kind.name))
        if grids is None:
            return (self._selected(inputs, items),)
        ends = grids.prod(1).cumsum(0)
        patches = torch.cat([torch.arange(ends[i] - grids[i].prod(), ends[i]) for i in items.tolist()])
        return self._selected(inputs, patches), grids[items]

    def encoder_inputs(self, module: ModuleRuntime, share: list[tuple[ModelCall, torch.Tensor]]) -> tuple:
        kind = encoder_kind(module.layout)
        inputs = [self._encoder_inputs(kind, call, items) for call, items in share]
        # Items are encoded independently (images side by side, patches with their grids): the
        # microbatches' items run as one batch.
        return inputs[0] if len(inputs) == 1 else tuple(torch.cat(parts) for parts in zip(*inputs))

    def encoder_forward(self, module: ModuleRuntime, share: list[tuple[ModelCall, torch.Tensor]], x):
        kind = encoder_kind(module.layout)
        out = module.part(*x) if module.first_stage else module.part(x)
        if module.last_stage and self.ablate_vision and kind.name == "vision":
            return out * 0  # the control run: no image information crosses the boundary
        return out

    def llm_forward(self, module: ModuleRuntime, call: ModelCall, share: slice, media: dict, hidden):
        llm, coords = module.layout, module.coords()
        positions = cp_positions(self.sizes.seq_length, llm.cp, coords["cp"])
        mrope = call.kwargs.get(POSITION_IDS_KEY)  # [b, 3, S] with M-RoPE, else None
        host = {key: call.kwargs[key][share][:, positions] for key in ("input_ids", "labels", "loss_mask")
                if call.kwargs.get(key) is not None}
        # The rotary embedding takes the sequence's positions: M-RoPE's whole [3, b, S] (it keeps this
        # rank's CP chunks), RoPE's this rank's
        host["position_ids"] = positions if mrope is None else mrope[share].transpose(0, 1)
        on = dict(zip(host, to_device(list(host.values()), _device())))  # one copy, the host not held
        ids, position_ids = on["input_ids"], on["position_ids"]
        position_ids = position_ids if mrope is not None else position_ids[None].expand_as(ids)
        b_local = ids.shape[0]
        rows = [(m.rows, input_rows(m.plan, b_local, _device())) for m in media.values()]
        documents = call.kwargs.get(DOCUMENTS_KEY)
        documents = None if documents is None else documents[share]  # on the host: llm_forward moves it
        out = llm_forward(module.part, ids, position_ids, rows, on.get("labels"), hidden, documents)
        return out, on.get("loss_mask")
