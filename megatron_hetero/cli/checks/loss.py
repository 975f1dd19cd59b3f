"""Is quack's cross entropy right on this GPU at the LLMs' vocabularies, and faster than megatron-core's
native fused one, which it replaces for the loss (models/loss_kernels.py)?

    megatron-hetero kernels check loss [--quick] [--record] [--out DIR]   (one GPU, quack importable)

Per case (tokens of one microbatch, vocabulary width; bf16 logits as the output layer gives them): each token's
loss and the logits' gradient (for a random gradient of the losses, as the loss mask and the averaging give) of
megatron-core's fused cross entropy and of quack's against fp32 math on the same bf16 logits, as max |diff| /
max |ref|; then both paths' forward and forward+backward ms (CUDA events, calls back to back) and the GPU's work
alone (common.gpu_ms). A quack error above TOLERANCE: FAIL, exit 1. Where every case passes, the kernel policy's
auto runs quack's loss on this GPU model once it is in the table of checked GPUs: --record writes it into the
user's table. Records (one JSON object per line) go to DIR/loss_check.jsonl; DIR defaults to $OUT or out/.
"""

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_hetero.cli.checks.common import KernelCheck, measure_paths, run_table
from megatron_hetero.models.kernel_policy import LOSS_KERNEL_ENV, record_check
from megatron_hetero.models.loss_kernels import cross_entropy, load_quack_cross_entropy

TOLERANCE = 0.02  # bf16 gradients are ~0.004 off fp32 by their rounding alone
DEVICE = "cuda"  # tests/test_loss_kernels.py runs the measuring on CPU with a stand-in kernel
ERRORS = ("loss", "dlogits")


class Case(NamedTuple):
    name: str
    tokens: int
    vocab: int


def cases(quick: bool) -> list[Case]:
    """The families' LLM vocabularies (padded as their LLMs run them) at one microbatch's tokens, and a
    width that is not a multiple of 8 (quack's narrower vector loads)."""
    cut = 8 if quick else 1
    return [Case("Qwen2.5-VL-7B LLM", 8192 // cut, 152064), Case("Qwen3-VL-8B LLM", 8192 // cut, 151936),
            Case("32K vocabulary, long sequence", 32768 // cut, 32768), Case("odd width", 4096 // cut, 151674)]


def inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 logits [tokens, 1, vocab] (spread as a trained output layer's), labels [tokens, 1], and a
    positive gradient of each token's loss."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(case.tokens, 1, case.vocab, device=DEVICE, generator=g) * 3).bfloat16()
    labels = torch.randint(0, case.vocab, (case.tokens, 1), device=DEVICE, generator=g)
    return logits, labels, torch.rand(case.tokens, 1, device=DEVICE, generator=g) / case.tokens


def reference(logits, labels):
    """fp32 math: logsumexp - the label's logit, per token."""
    x = logits.float()
    return torch.logsumexp(x, -1) - x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def megatron_loss(logits, labels):
    """megatron-core's native fused cross entropy (a process group of this process alone)."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    return fused_vocab_parallel_cross_entropy(logits, labels, dist.group.WORLD)


def quack_loss(logits, labels):
    return cross_entropy(logits, labels, load_quack_cross_entropy()[0])


def _grads(loss_fn, case: Case, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """loss_fn's losses and the logits' gradient in fp32, the logits given to it in `dtype`."""
    logits, labels, dloss = inputs(case)
    logits = logits.to(dtype).requires_grad_()
    loss = loss_fn(logits, labels)
    loss.backward(dloss)
    return [loss.detach().float(), logits.grad.float()]


def errors(loss_fn, case: Case) -> dict[str, float]:
    """Max |diff| / max |ref| of the losses and the logits' gradient against fp32 math on the same
    (bf16) logits."""
    want = _grads(reference, case, torch.float32)
    return {name: float((a - r).abs().max() / r.abs().max())
            for name, a, r in zip(ERRORS, _grads(loss_fn, case), want)}


def calls(loss_fn, case: Case) -> tuple[Callable, Callable]:
    """A forward call and a forward and backward call of loss_fn, to be timed."""
    logits, labels, dloss = inputs(case)
    logits.requires_grad_()
    return lambda: loss_fn(logits, labels), lambda: loss_fn(logits, labels).backward(dloss)


def measure(case: Case, iters: int) -> dict:
    """Both paths' errors and times; ok: quack's errors within TOLERANCE."""
    return measure_paths(dict(case=case.name, tokens=case.tokens, vocab=case.vocab), case,
                         {"torch": megatron_loss, "quack": quack_loss}, errors, calls, iters, "quack", TOLERANCE)


def main(quick: bool, out: str, record: bool) -> int:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        status = run_table(KernelCheck(lambda: load_quack_cross_entropy()[1], cases, measure, "vocab",
                                      "megatron-core fused err (loss / dlogits) | quack err", "loss_check.jsonl",
                                      f"quack's loss above {TOLERANCE} of fp32", f"{LOSS_KERNEL_ENV}=torch",
                                      passed="quack's cross entropy is right here"), quick, out)
    finally:
        dist.destroy_process_group()
    name = torch.cuda.get_device_name()
    if status == 0 and record:
        print(f"recorded {name} in {record_check(name, quack_loss=True)}: the kernel policy's auto runs it")
    elif status == 0:
        print(f"to run it on {name}: run again with --record, or export {LOSS_KERNEL_ENV}=quack")
    return status
