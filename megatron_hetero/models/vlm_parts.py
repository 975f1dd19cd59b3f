"""This project's reference multimodal model (models/vlm.py: encoders of the registered kinds and a
GPTModel on our TE-free layers) as per-module parts for megatron.training, and its adapter.

The script calls `model(input_ids=, labels=, loss_mask=, <kind input>=, <kind>_counts=,
<kind>_positions=[, document_ids=])` on a global microbatch (data/sample_batch.py): per sequence,
its token ids, labels and loss mask [S] (and with packing the sample of each token); per kind,
ragged over the samples, every item (images [3, H, W], clips [mel, frames]), the items per sequence
and the sequence positions their rows fill. The LLM takes its data-parallel rank's sequences and its
context-parallel positions (Megatron's load-balanced chunks); an encoder's data-parallel ranks take
the items by cost (boundary.assign_items). On the last LLM stage the model returns (per-token losses
[b, s_local], loss mask [b, s_local]) for the script's loss function.
"""

import numpy as np
import torch

from megatron_hetero.boundary import BoundaryBatch, assign_items, input_rows
from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.models.init import build_stage
from megatron_hetero.models.kinds import DOCUMENTS_KEY, counts_key, encoder_kind, positions_key
from megatron_hetero.models.sizes import ModelSizes
from megatron_hetero.models.vlm import build_llm, llm_forward
from megatron_hetero.runtime.context import HeteroRun, ModuleRuntime
from megatron_hetero.runtime.model import ModelCall, ModelParts


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
                return encoder_kind(layout).build(sizes, layout.tp, pgs, dtype, whole=whole, **fields)
        parts[module.name] = build_stage(build, seed + index, layout.pp, ep=layout.ep)
    return ModelParts(parts, VLMAdapter(run, sizes, ablate_vision, dtype))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class VLMAdapter:
    def __init__(self, run: HeteroRun, sizes: ModelSizes, ablate_vision: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.run, self.sizes, self.ablate_vision, self.dtype = run, sizes, ablate_vision, dtype

    def batch_size(self, call: ModelCall) -> int:
        return call.kwargs["input_ids"].shape[0]

    def boundary_like(self) -> torch.Tensor:
        return torch.zeros(0, self.sizes.hidden_size, dtype=self.dtype, device=_device())

    def _llm_seq_local(self) -> int:
        llm = self.run.layout.llm
        return self.sizes.seq_length // llm.cp // (llm.tp if llm.sp else 1)

    def stage_hidden_like(self, module: ModuleRuntime, call: ModelCall, share) -> torch.Tensor:
        if module.layout.role == "llm":
            shape = (self._llm_seq_local(), share.stop - share.start, self.sizes.hidden_size)
        else:
            kind = encoder_kind(module.layout)
            shape = (kind.stage_tokens(self.sizes), len(share), kind.hidden_size(self.sizes))
        return torch.empty(shape, dtype=self.dtype, device=_device())

    def boundary_batch(self, name: str, call: ModelCall) -> BoundaryBatch:
        """Every item sends tokens_per_item rows; items go to the encoder's DP ranks by the cost of
        its tokens per item (all alike here: round robin)."""
        module = self.run.layout.module(name)
        kind = encoder_kind(module)
        counts = call.kwargs[counts_key(kind.name)].cpu().numpy()
        items = int(counts.sum())
        tokens, width = kind.item_shape(self.sizes)
        item_dp = assign_items(np.full(items, tokens), width, module.dp)
        rows = kind.tokens_per_item(self.sizes)
        return BoundaryBatch(counts * rows, call.kwargs[positions_key(kind.name)].cpu().numpy(),
                             call.kwargs["input_ids"].shape[1], np.full(items, rows), item_dp)

    def encoder_forward(self, module: ModuleRuntime, call: ModelCall, items: torch.Tensor, hidden):
        kind = encoder_kind(module.layout)
        if hidden is None:
            hidden = call.kwargs[kind.input_key][items].to(device=_device(), dtype=self.dtype)
        out = module.part(hidden)
        if module.last_stage and self.ablate_vision and kind.name == "vision":
            return out * 0  # the control run: no image information crosses the boundary
        return out

    def llm_forward(self, module: ModuleRuntime, call: ModelCall, share: slice, media: dict, hidden):
        llm, coords = module.layout, module.coords()
        positions = cp_positions(self.sizes.seq_length, llm.cp, coords["cp"])
        ids, labels, loss_mask = (
            None if call.kwargs.get(key) is None else call.kwargs[key][share][:, positions].to(_device())
            for key in ("input_ids", "labels", "loss_mask"))
        b_local = ids.shape[0]
        rows = [(m.rows, input_rows(m.plan, b_local, _device())) for m in media.values()]
        documents = call.kwargs.get(DOCUMENTS_KEY)
        documents = None if documents is None else documents[share]  # on the host: llm_forward moves it
        out = llm_forward(module.part, ids, positions.to(_device())[None].expand_as(ids), rows,
                          labels, hidden, documents)
        return out, loss_mask
