"""The LLM side of Qwen3-VL: DeepStack rows added between its first layers, and interleaved M-RoPE.

DeepStack (transformers' Qwen3VLTextModel._deepstack_process): the vision tower's extra mergers give
one row per image token for each of the first K LLM layers; row block r is added to the output of
LLM layer r at the image's positions. The encoder sends them as extra columns of its rows
([main | block 0 | block 1 | ...], families/qwen3_vl/vision.py), so the boundary moves every edge
with the main rows (plan, re-layout and gradient routing unchanged). On the LLM's first stage the
extra columns become dense [s, b, h] additions (the rows written at their slots, zeros elsewhere:
one per block); a forward hook adds block r to layer r's output on the stage that owns layer r. A
block whose layer sits on a later pipeline stage rides along with the hidden states: a stage sends
[s, b, h * (1 + blocks still to add)], so it crosses stage boundaries exactly, forward and backward
(autograd carries the additions' gradients back to the rows and over the boundary to the tower).
"""

from contextlib import contextmanager

import torch
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

from megatron_hetero.boundary.rows import write_rows
from megatron_hetero.models.mrope import interleaved_axes


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """megatron-core's M-RoPE with Qwen3-VL's interleaved frequency sections (models/mrope.py:
    interleaved_axes) in place of contiguous ones; the same arguments and output [S, b, 1, dim]. The
    sections are the model's (`mrope_section`, the config's): their frequencies' axes go to the device
    once, here, not in every forward (a blocking copy from the host, which waits for the device)."""

    def __init__(self, kv_channels: int, rotary_percent: float, mrope_section, **kwargs):
        super().__init__(kv_channels, rotary_percent, **kwargs)
        self.mrope_section = list(mrope_section)
        self.axes = interleaved_axes(len(self.inv_freq), self.mrope_section).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        if list(mrope_section) != self.mrope_section:
            raise ValueError(f"M-RoPE sections {list(mrope_section)}: this embedding was built for "
                             f"{self.mrope_section}")
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float)  # [3, b, S]
        freqs = positions[..., None] * self.inv_freq  # [3, b, S, dim / 2]
        freqs = freqs.gather(0, self.axes.expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [S, b, 1, dim]
        cp_group = self.cp_group if cp_group is None else cp_group
        if cp_group is not None and cp_group.size() > 1:
            # through the module megatron-core's own M-RoPE calls it from (patches/cpu.py replaces it there)
            emb = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


def split_rows(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An encoder's boundary rows [n, h * (1 + k)] -> (the main rows [n, h], k DeepStack blocks)."""
    main, *blocks = rows.split(hidden, dim=-1)
    return main, blocks


def dense_additions(blocks: list[torch.Tensor], at: torch.Tensor, like: torch.Tensor) -> list[torch.Tensor]:
    """Each block's rows written at their slots `at` of a zero [s, b, h] like the LLM's input."""
    return [write_rows(torch.zeros_like(like), block, at) for block in blocks]


def _add_to_output(addition: torch.Tensor):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + addition, *output[1:])
        return output + addition
    return hook


@contextmanager
def added_after_layers(llm, additions: list[torch.Tensor]):
    """Within the block: addition r joins the output of this stage's layer r (the additions start at
    the stage's first layer); those past its layers are yielded, for the next stage. Refused under
    full recomputation, which would rerun the layers without the hooks."""
    layers = llm.decoder.layers
    if additions and llm.config.recompute_granularity == "full":
        raise ValueError("DeepStack rows are added between LLM layers, which full recomputation reruns "
                         "without them; use --recompute-granularity selective or none")
    handles = [layers[r].register_forward_hook(_add_to_output(a)) for r, a in enumerate(additions) if r < len(layers)]
    try:
        yield additions[len(layers):]
    finally:
        for handle in handles:
            handle.remove()


def stage_width(blocks: int, num_layers: int, pp: int, stage: int) -> int:
    """Hidden-state blocks (1 + DeepStack blocks still to add) that LLM stage `stage` takes in, of
    `blocks` DeepStack blocks into layers 0..blocks-1 of `num_layers` over `pp` equal stages."""
    return 1 + max(0, blocks - stage * (num_layers // pp))
