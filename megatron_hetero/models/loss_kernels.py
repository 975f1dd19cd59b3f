"""The LLM's loss on quack's cross entropy, where megatron-core runs its native fused one (Megatron's
--cross-entropy-loss-fusion with --cross-entropy-fusion-impl native, the default implementation).

Why: megatron-core's fused cross entropy is its vocabulary-parallel algorithm compiled (torch.compile)
into five kernels over fp32 copies of the logits. In the Qwen2.5-VL-7B-shaped step on one H200 (4 LLM
layers, global batch 4; docs/runs/h200_one_card/windows_flash/ab/profile_B_qwen2_5_vl_7b.md) they took
59 ms of the step's 1,678 for 4 microbatches of 8,192 tokens x 152,064 logits, and the loss holds 10
bytes per logit while it runs, the step's peak (planner/counts.py). quack's kernel reads the bf16
logits once forward (each token's loss and log-sum-exp, in fp32) and once backward (writing the bf16
gradient): about three passes over the logits' bytes in all, holding the logits and, while it is
written, their gradient (QUACK_LOGIT_BYTES).

The same function: loss = log-sum-exp(logits) - logits[label] per token, in fp32 from the logits'
dtype, and the gradient (softmax - one-hot) x the loss's gradient, rounded to the logits' dtype, as
megatron-core's (which differs by the order of its sums). A label outside the vocabulary (none in
this project's data: masked tokens keep real ids, the loss mask drops them) counts 0 here, where
megatron-core counts the log-sum-exp less the largest logit; the loss mask drops either.

Where: the whole vocabulary on one rank (quack's kernel has no reduction over a vocabulary split by
tensor parallelism: under TP megatron-core's), on GPUs quack targets, as the layer's kernel policy
(MEGATRON_HETERO_LOSS_KERNEL) says: auto on GPU models whose `megatron-hetero kernels check loss`
passed (kernel_policy.QUACK_LOSS_CHECKED: the shipped table and the user's), quack on every one,
torch never. The choice is pure (choose_loss_kernel), tested without a GPU.

Wide vocabularies: on Hopper quack's forward runs a row wider than FORWARD_WIDTH (bf16) on a cluster of
16 blocks, and on an H200 quack 0.6.5 returned NaN there for rows loaded as 16-byte vectors (151,680,
and the Qwen families' 151,936 and 152,064 columns; right at 131,072 and at 151,674). Such a row's
log-sum-exp is taken over column chunks of at most FORWARD_WIDTH, combined; the backward, which tiles
a row in 16K-column blocks without clusters, runs once over the whole row. So `kernels check loss`
passes on the H200 at both vocabularies.
"""

import functools
from typing import Callable, NamedTuple

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule

from megatron_hetero.models import kernel_policy
from megatron_hetero.models.attention_kernels import current_device, import_failure
from megatron_hetero.models.kernel_policy import LOSS_KERNEL_ENV, QUACK_LOSS_CHECKED, KernelPolicy
from megatron_hetero.models.quack_kernels import QUACK, TORCH, QuackChoice, quack_kernel_for

IGNORED = -100  # quack's label of a token whose loss and gradient are 0: a label outside the vocabulary
FORWARD_WIDTH = 128 * 1024  # quack's widest bf16 row on a cluster of 8 (the module docstring)
VECTOR = 8  # bf16 elements of a 16-byte load: the rows whose chunks stay aligned as quack assumes


class QuackCrossEntropy(NamedTuple):
    """quack's cross entropy kernels (quack.cross_entropy): forward(logits [M, V], labels [M],
    ignore_index=, return_lse=True) -> (loss [M], lse [M]) in fp32; backward(logits, labels, dloss [M],
    lse, ignore_index=) -> dlogits [M, V] in the logits' dtype."""

    forward: Callable
    backward: Callable


@functools.cache
def load_quack_cross_entropy() -> tuple[QuackCrossEntropy | None, str | None]:
    """(quack's cross entropy kernels, None), or (None, why they do not load)."""
    try:
        from quack.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
    except Exception as error:  # ImportError, or the CuTe DSL failing to load its libraries
        return None, import_failure("quack", error)
    return QuackCrossEntropy(cross_entropy_fwd, cross_entropy_bwd), None


def choose_loss_kernel(base: QuackChoice, tp: int, device_name: str, mode: str,
                       checked: tuple[str, ...]) -> QuackChoice:
    """The loss's kernel from quack's rule for the policy's loss mode on this GPU (`base`), the
    vocabulary's TP split and the GPU models where quack's cross entropy passed its check."""
    if base.kernel != QUACK:
        return base
    if tp > 1:
        return QuackChoice(TORCH, f"vocabulary split over TP {tp}: megatron-core's")
    if mode == "auto" and device_name not in checked:
        return QuackChoice(TORCH, f"not checked on {device_name}: megatron-hetero kernels check loss --record")
    return QuackChoice(QUACK, "cross entropy")


def loss_kernel_for(policy: KernelPolicy, tp: int) -> QuackChoice:
    """The kernel of the fused loss under `policy` (its loss mode) on this process's GPU, the vocabulary
    split over `tp` ranks."""
    base = quack_kernel_for(LOSS_KERNEL_ENV, policy.loss, load_quack_cross_entropy)
    return choose_loss_kernel(base, tp, current_device().name, policy.loss, QUACK_LOSS_CHECKED)


def fused_loss_choice(config, tp: int) -> QuackChoice:
    """The kernel of the loss of a model of `config` (a TransformerConfig) whose vocabulary is split over
    `tp` ranks: quack's only in place of megatron-core's native fused cross entropy."""
    if not config.cross_entropy_loss_fusion:
        return QuackChoice(TORCH, "megatron-core's; --cross-entropy-loss-fusion off")
    if config.cross_entropy_fusion_impl != "native":
        return QuackChoice(TORCH, f"--cross-entropy-fusion-impl {config.cross_entropy_fusion_impl}")
    return loss_kernel_for(kernel_policy.of(config), tp)


def column_chunks(vocab: int) -> list[slice]:
    """The column chunks of a row of `vocab` logits that quack's forward takes one call each: the whole
    row, or chunks of FORWARD_WIDTH where a wider row loads as 16-byte vectors."""
    if vocab <= FORWARD_WIDTH or vocab % VECTOR:
        return [slice(0, vocab)]
    return [slice(start, min(start + FORWARD_WIDTH, vocab)) for start in range(0, vocab, FORWARD_WIDTH)]


def _loss_and_lse(logits, labels, kernels):
    """Each row's loss and log-sum-exp (fp32) on quack's forward, per column chunk where it must be."""
    chunks = column_chunks(logits.shape[1])
    if len(chunks) == 1:
        return kernels.forward(logits, labels, ignore_index=IGNORED, return_lse=True)
    ignored = torch.full_like(labels, IGNORED)  # each chunk's log-sum-exp alone: no label read
    lse = torch.stack([kernels.forward(logits[:, cols], ignored, ignore_index=IGNORED, return_lse=True)[1]
                       for cols in chunks]).logsumexp(0)
    picked = logits.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1).float()
    return torch.where(labels != IGNORED, lse - picked, 0.0), lse


class _CrossEntropy(torch.autograd.Function):
    """forward: each token's loss, logsumexp(logits) - logits[label], in fp32 (quack's kernel, one pass);
    backward: (softmax - one-hot) x dloss in the logits' dtype (one pass, from the saved log-sum-exp)."""

    @staticmethod
    def forward(ctx, logits, labels, kernels):
        loss, lse = _loss_and_lse(logits, labels, kernels)
        ctx.save_for_backward(logits, labels, lse)
        ctx.kernels = kernels
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, labels, lse = ctx.saved_tensors
        # quack's backward reads the losses' gradient as fp32 [M]
        return ctx.kernels.backward(logits, labels, dloss.float().contiguous(), lse, ignore_index=IGNORED), None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, kernels: QuackCrossEntropy) -> torch.Tensor:
    """Each token's loss (fp32, labels' shape) of `logits` [..., V] (the whole vocabulary) on `kernels`."""
    vocab = logits.shape[-1]
    labels = labels.reshape(-1)
    labels = torch.where((labels >= 0) & (labels < vocab), labels, IGNORED)
    return _CrossEntropy.apply(logits.reshape(-1, vocab), labels, kernels).view(logits.shape[:-1])


def loss_summary(module: torch.nn.Module) -> str:
    """What a model part's loss runs (e.g. "quack (cross entropy)", "torch (vocabulary split over TP 2:
    megatron-core's)"), for the start-up line and benchmark records; "none" for a part without a loss."""
    found = [str(fused_loss_choice(sub.config, sub.pg_collection.tp.size())) for sub in module.modules()
             if isinstance(sub, LanguageModule) and getattr(sub, "post_process", False)]
    return "; ".join(dict.fromkeys(found)) or "none"
