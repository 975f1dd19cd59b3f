"""The LLM's padded vocabulary: rows past the tokenizer's vocabulary are not the model's.

megatron-core's embedding and output layer split the vocabulary into TP equal parts, so it is padded
(sizes.padded_vocab_size: a multiple the TP size divides, more rows for TP 3 than for TP 2). For the
model to be the same under every TP size, and a checkpoint to load under a TP whose padding differs:
- the padding's logits are -inf: no probability, no loss, no gradient (the output layer's padding
  rows are never trained and never matter);
- the embedding draws its initial weights for the TP-1 ("whole") padded rows only, the rest zero, so
  the random stream the layers after it draw from does not depend on the TP size;
- both weights carry `whole_rows` (the TP-1 row count): full_state.full_tensors trims them to it and
  load_full_tensors pads them (zeros); megatron-core marks them `allow_shape_mismatch` in checkpoints,
  whose load reads the rows both sizes have and zero-fills the others (runtime/checkpoint.py accepts
  such a difference in rows only).
"""

from collections.abc import Callable

import torch


def first_rows_init(init: Callable, rows: int) -> Callable:
    """An init method drawing `init`'s values for the first `rows` rows only, zeros below them."""
    def init_first_rows(weight: torch.Tensor) -> None:
        init(weight[:rows])
        weight[rows:].zero_()
    return init_first_rows


def _global_rows(weight: torch.Tensor, tp_group) -> torch.Tensor:
    """Global row numbers of this TP rank's rows of a vocabulary-split weight."""
    local = weight.shape[0]
    return torch.arange(local, device=weight.device) + tp_group.rank() * local


class _PaddingToNegInf(torch.autograd.Function):
    """forward: the logits' last columns, from `first` on, set to -inf in place; backward: their
    gradient zeroed. (masked_fill with a mask over every column read and wrote the whole logits twice
    more in the forward and in the backward: 11 ms a microbatch of 8,192 tokens x 151,680 on an H100.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, first: int) -> torch.Tensor:
        ctx.mark_dirty(logits)
        ctx.first = first
        logits[..., first:] = float("-inf")
        return logits

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()  # the incoming gradient may be shared with another node
        grad[..., ctx.first:] = 0
        return grad, None


def _mask_padding(vocab_size: int, padded: int, tp_group):
    """A forward hook of the output layer: logits of the padding at -inf (its local columns, or all
    columns where the output is gathered)."""
    def hook(module, args, output):
        logits, bias = output
        local = logits.shape[-1]
        start = 0 if local == padded else tp_group.rank() * local
        if start + local <= vocab_size:
            return output
        return _PaddingToNegInf.apply(logits, max(vocab_size - start, 0)), bias
    return hook


@torch.no_grad()
def pad_vocab(llm, vocab_size: int, whole_rows: int, tp_group) -> None:
    """Mark and zero the padding of a GPTModel stage's embedding and output layer (past `whole_rows`)
    and mask its logits past `vocab_size` (see the module docstring)."""
    weights = []
    if llm.pre_process:
        weights.append(llm.embedding.word_embeddings.weight)
    if llm.post_process:
        padded = llm.output_layer.output_size
        llm.output_layer.register_forward_hook(_mask_padding(vocab_size, padded, tp_group))
        if llm.output_layer.weight is not None:
            weights.append(llm.output_layer.weight)
    for weight in weights:
        weight.whole_rows = whole_rows
        weight[_global_rows(weight, tp_group) >= whole_rows] = 0


def resized_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with `rows` rows: trimmed, or padded with zeros."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
