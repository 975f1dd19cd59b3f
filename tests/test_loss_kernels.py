"""The LLM's loss on quack's cross entropy (models/loss_kernels.py, patches/loss.py, cli/checks/loss.py):
- which kernel the loss runs by mode, GPU, the table of checked GPUs and the vocabulary's TP split (pure);
- the patched compute_language_model_loss on a pure-torch stand-in with quack's call signatures against
  megatron-core's own loss, unfused and native fused (one process): the same losses [b, s] and logits'
  gradients; a label outside the vocabulary counts 0; under TP, or without the fusion, upstream's runs;
- the GPU check's judging on CPU with the stand-in: a right kernel passes, a wrong gradient fails;
- the checked GPUs' list in the kernel checks table (the planner's bytes per logit: test_planner.py).
The real kernels are checked on a GPU by `megatron-hetero kernels check loss`."""

import inspect
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import AttnBackend

from megatron_hetero.models import kernel_policy, loss_kernels
from megatron_hetero.models.attention_kernels import Device
from megatron_hetero.models.kernel_policy import LOSS_KERNEL_ENV, KernelPolicy
from megatron_hetero.models.loss_kernels import (
    QuackCrossEntropy,
    choose_loss_kernel,
    fused_loss_choice,
    loss_kernel_for,
)
from megatron_hetero.models.quack_kernels import QUACK, TORCH, QuackChoice, choose_quack
from megatron_hetero.patches.loss import _loss

H200 = "NVIDIA H200"


# ---- the choice ----------------------------------------------------------------------------------
def test_which_kernel_the_loss_runs():
    quack = QuackChoice(QUACK)
    assert choose_loss_kernel(QuackChoice(TORCH, "no GPU"), 1, "cpu", "auto", ()) == QuackChoice(TORCH, "no GPU")
    assert choose_loss_kernel(quack, 1, H200, "auto", checked=(H200,)) == QuackChoice(QUACK, "cross entropy")
    assert str(choose_loss_kernel(quack, 1, H200, "auto", checked=())) == (
        f"torch (not checked on {H200}: megatron-hetero kernels check loss --record)")
    assert choose_loss_kernel(quack, 1, H200, "quack", checked=()).kernel == QUACK  # the user's choice
    assert str(choose_loss_kernel(quack, 2, H200, "quack", checked=(H200,))) == (
        "torch (vocabulary split over TP 2: megatron-core's)")
    assert str(loss_kernel_for(KernelPolicy(loss="torch"), 1)) == f"torch ({LOSS_KERNEL_ENV}=torch)"
    assert str(loss_kernel_for(KernelPolicy(), 1)) == "torch (no GPU)"


def _config(fusion=True, impl="native"):
    return SimpleNamespace(cross_entropy_loss_fusion=fusion, cross_entropy_fusion_impl=impl,
                           attention_backend=AttnBackend.auto, flash_attention_version=None, transformer_impl="local")


def test_only_megatrons_native_fused_loss_is_replaced(monkeypatch):
    _on_an_h200(monkeypatch)
    assert fused_loss_choice(_config(), 1).kernel == QUACK
    off = "torch (megatron-core's; --cross-entropy-loss-fusion off)"
    assert str(fused_loss_choice(_config(fusion=False), 1)) == off
    assert str(fused_loss_choice(_config(impl="te"), 1)) == "torch (--cross-entropy-fusion-impl te)"
    assert fused_loss_choice(_config(), 4).kernel == TORCH


# ---- the loss on the stand-in ----------------------------------------------------------------------
def _forward(x, target, ignore_index=-100, return_lse=False):
    """quack.cross_entropy.cross_entropy_fwd's outputs: each row's loss and log-sum-exp in fp32 (fp64 here
    for fp64 logits), 0 loss where the label is ignore_index."""
    assert x.dim() == 2 and target.dim() == 1 and return_lse
    acc = torch.promote_types(x.dtype, torch.float32)
    lse = torch.logsumexp(x.to(acc), -1)
    picked = x.to(acc).gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(target != ignore_index, lse - picked, 0.0), lse


def _backward(x, target, dloss, lse, ignore_index=-100):
    """quack.cross_entropy.cross_entropy_bwd's: (softmax - one-hot) x dloss in x's dtype, 0 where ignored."""
    assert dloss.dim() == 1 and dloss.is_contiguous() and dloss.dtype == torch.float32
    probabilities = torch.exp(x.to(lse.dtype) - lse.unsqueeze(1))
    probabilities.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
    return (probabilities * (dloss * (target != ignore_index)).unsqueeze(1)).to(x.dtype)


STAND_IN = QuackCrossEntropy(_forward, _backward)


def _module(config, tp=None):
    """A language model's loss part: megatron-core's LanguageModule with its config and TP group."""
    module = object.__new__(LanguageModule)
    torch.nn.Module.__init__(module)
    module.config, module.tp_group = config, tp or dist.group.WORLD
    module.pg_collection = SimpleNamespace(tp=module.tp_group)
    return module


def _loss_and_grad(compute, module, logits, labels, dloss):
    logits = logits.clone().requires_grad_()
    loss = compute(module, labels, logits)
    loss.backward(dloss)
    return loss.detach(), logits.grad


def _inputs(s: int, b: int, vocab: int, seed: int):
    """Logits [s, b, V] as GPTModel hands them, labels [b, s], and a gradient of the losses [b, s]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, b, vocab, generator=g) * 3, torch.randint(0, vocab, (b, s), generator=g),
            torch.rand(b, s, generator=g))


def _on_an_h200(monkeypatch, kernels=STAND_IN):
    """This process as on an H200 whose quack loads (`kernels`), under MEGATRON_HETERO_LOSS_KERNEL=quack."""
    h200 = Device(H200, (9, 0))
    monkeypatch.setattr(loss_kernels, "quack_kernel_for", lambda env, mode, load: choose_quack(env, mode, h200))
    monkeypatch.setattr(loss_kernels, "current_device", lambda: h200)
    monkeypatch.setattr(loss_kernels, "load_quack_cross_entropy", lambda: (kernels, None))
    monkeypatch.setenv(LOSS_KERNEL_ENV, "quack")


def test_the_loss_on_quack_equals_megatron_cores(one_rank, monkeypatch):
    """Labels [b, s], logits [s, b, V] as GPTModel hands them: the losses [b, s] and the logits' gradient
    as megatron-core's unfused loss gives them (its fused one: the same losses, its gradient in bf16)."""
    _on_an_h200(monkeypatch)
    s, b, vocab = 7, 3, 50
    logits, labels, dloss = _inputs(s, b, vocab, seed=0)
    upstream = inspect.unwrap(LanguageModule.compute_language_model_loss)  # whether or not patched here
    ours = _loss_and_grad(_loss(upstream), _module(_config()), logits, labels, dloss)
    unfused = _loss_and_grad(upstream, _module(_config(fusion=False)), logits, labels, dloss)
    fused = _loss_and_grad(upstream, _module(_config()), logits, labels, dloss)
    assert ours[0].shape == (b, s) and ours[0].dtype == torch.float32
    torch.testing.assert_close(ours, unfused, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[0], fused[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(fused[1], fused[1].bfloat16().float())  # megatron-core's fused gradient: rounded to bf16
    torch.testing.assert_close(ours[1], fused[1], rtol=1e-2, atol=1e-3)
    # A label outside the vocabulary: loss and gradient 0 for that token, the others unchanged.
    labels[1, 4] = vocab
    loss, grad = _loss_and_grad(_loss(upstream), _module(_config()), logits, labels, dloss)
    assert loss[1, 4] == 0 and not grad[4, 1].any()
    kept = torch.ones(b, s, dtype=torch.bool)
    kept[1, 4] = False
    torch.testing.assert_close(loss[kept], ours[0][kept])


def test_a_wide_vocabulary_goes_forward_in_column_chunks(one_rank, monkeypatch):
    """Rows wider than FORWARD_WIDTH that load as 16-byte vectors: quack's forward gets chunks of at most
    that width, the log-sum-exps combined; losses and gradient as from one call."""
    assert [(c.start, c.stop) for c in loss_kernels.column_chunks(152064)] == [(0, 131072), (131072, 152064)]
    assert [(c.start, c.stop) for c in loss_kernels.column_chunks(151674)] == [(0, 151674)]  # 2-element loads
    assert [(c.start, c.stop) for c in loss_kernels.column_chunks(131072)] == [(0, 131072)]
    widths = []

    def forward(x, target, ignore_index=-100, return_lse=False):
        widths.append(x.shape[1])
        return _forward(x, target, ignore_index, return_lse)

    _on_an_h200(monkeypatch, QuackCrossEntropy(forward, _backward))
    s, b, vocab = 7, 3, 48
    logits, labels, dloss = _inputs(s, b, vocab, seed=1)
    labels[1, 4] = vocab  # outside the vocabulary: loss and gradient 0
    compute = _loss(inspect.unwrap(LanguageModule.compute_language_model_loss))
    whole = _loss_and_grad(compute, _module(_config()), logits, labels, dloss)
    assert widths == [vocab]
    monkeypatch.setattr(loss_kernels, "FORWARD_WIDTH", 16)
    chunked = _loss_and_grad(compute, _module(_config()), logits, labels, dloss)
    assert widths[1:] == [16, 16, 16]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    assert chunked[0][1, 4] == 0 and not chunked[1][4, 1].any()


def test_upstreams_loss_runs_where_quacks_does_not(one_rank, monkeypatch):
    _on_an_h200(monkeypatch)
    compute = _loss(lambda self, labels, logits: "upstream")
    tp2 = SimpleNamespace(size=lambda: 2)
    assert compute(_module(_config(), tp=tp2), None, None) == "upstream"
    assert compute(_module(_config(fusion=False)), None, None) == "upstream"
    monkeypatch.setenv(LOSS_KERNEL_ENV, "torch")
    assert compute(_module(_config()), None, None) == "upstream"
    monkeypatch.setenv(LOSS_KERNEL_ENV, "auto")  # an H200 not in the table of checked GPUs
    monkeypatch.setattr(loss_kernels, "QUACK_LOSS_CHECKED", ())
    assert compute(_module(_config()), None, None) == "upstream"


# ---- the GPU check's judging ----------------------------------------------------------------------
def test_gpu_check_passes_a_right_kernel_and_fails_a_wrong_gradient(one_rank, monkeypatch):
    from megatron_hetero.cli.checks import loss as check

    def wrong(x, target, dloss, lse, ignore_index=-100):
        return _backward(x, target, dloss, lse, ignore_index) * 1.5

    monkeypatch.setattr(check, "DEVICE", "cpu")
    for kernels, right in ((STAND_IN, True), (QuackCrossEntropy(_forward, wrong), False)):
        monkeypatch.setattr(check, "load_quack_cross_entropy", lambda kernels=kernels: (kernels, None))
        record = check.measure(check.Case("test", 64, 1000), iters=0)
        assert record["ok"] == right and record["torch_dlogits_err"] < check.TOLERANCE, record
        assert record["quack_loss_err"] < 1e-5, record
        if not right:
            assert record["quack_dlogits_err"] > 0.2, record


# ---- the table of checked GPUs ---------------------------------------------------------------------
def test_the_checked_gpus_are_a_list_of_the_table(tmp_path):
    assert kernel_policy.QUACK_LOSS_CHECKED == tuple(json.loads(kernel_policy.CHECKS_FILE.read_text())
                                                     ["quack_loss_checked"])
    path = tmp_path / "checks.json"
    path.write_text('{"fa4_checked_head_dims": {}, "cudnn_merge_checked": ["A"]}')  # written before the list
    gpu = "NVIDIA B200"  # not in the shipped table
    kernel_policy.record_check(gpu, quack_loss=True, path=path)
    kernel_policy.record_check(gpu, quack_loss=True, path=path)
    assert json.loads(path.read_text()) == {"fa4_checked_head_dims": {}, "cudnn_merge_checked": ["A"],
                                            "quack_loss_checked": [gpu], "short_attention_checked": [],
                                            "gated_bias_mlp_checked": []}
    _, lists = kernel_policy.load_checks(kernel_policy.CHECKS_FILE, path)
    assert lists["quack_loss_checked"] == (*kernel_policy.QUACK_LOSS_CHECKED, gpu)

