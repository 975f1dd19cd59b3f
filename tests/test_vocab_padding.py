"""The padded vocabulary's logits (models/vocab.py): the output layer's hook sets the padding's columns
to -inf and zeroes their gradient, as masked_fill over a column mask does, on a TP rank's local
columns and on gathered logits: the same logits, loss and gradients (input and weight), bit for bit,
from the loss and from any gradient reaching the logits."""

import pytest
import torch

from megatron_hetero.models.vocab import _mask_padding


class _Rank:
    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


class _OutputLayer(torch.nn.Module):
    """megatron-core's output layer's interface: (logits, bias)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x):
        return x @ self.weight.t(), None


def _masked_fill_hook(vocab_size: int, padded: int, rank: int):
    def hook(module, args, output):
        logits, bias = output
        local = logits.shape[-1]
        start = 0 if local == padded else rank * local
        padding = torch.arange(start, start + local) >= vocab_size
        return logits.masked_fill(padding, float("-inf")), bias
    return hook


def _run(hook, weight, x, target, grad):
    """The logits, the loss, and the input and weight gradients of the loss and, apart, of `grad`
    reaching the logits (nonzero at the padding too, as no loss over them would send)."""
    results = []
    for backward in ("loss", "grad"):
        layer = _OutputLayer(weight)
        layer.register_forward_hook(hook)
        leaf = x.clone().requires_grad_()
        logits, _ = layer(leaf)
        loss = torch.nn.functional.cross_entropy(logits.float(), target)
        loss.backward() if backward == "loss" else logits.backward(grad)
        results += [logits.detach(), loss.detach(), leaf.grad, layer.weight.grad]
    return results


@pytest.mark.parametrize("local,rank", [(16, 0), (16, 1), (32, 0)], ids=["tp2_rank0", "tp2_rank1", "gathered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_logits_as_masked_fill(local, rank, dtype):
    vocab_size, padded, hidden, tokens = 27, 32, 8, 12
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(local, hidden, generator=g).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    start = 0 if local == padded else rank * local
    target = torch.randint(0, min(local, vocab_size - start), (tokens,), generator=g)  # the rank's real columns
    grad = torch.randn(tokens, local, generator=g).to(dtype)
    ours = _run(_mask_padding(vocab_size, padded, _Rank(rank)), weight, x, target, grad)
    reference = _run(_masked_fill_hook(vocab_size, padded, rank), weight, x, target, grad)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    masked = ~torch.isfinite(ours[0])
    assert masked.any() == (start + local > vocab_size)
    assert masked.all(0).sum() == max(0, start + local - max(vocab_size, start))


def test_no_padding_leaves_logits_alone():
    layer = _OutputLayer(torch.randn(16, 8))
    layer.register_forward_hook(_mask_padding(16, 16, _Rank(0)))
    logits, _ = layer(torch.randn(3, 8))
    assert torch.isfinite(logits).all()
