"""The attention kernel choice and the flash-attn-4 path, without a GPU (CI never has flash-attn-4).

- which kernel each device / import status / dtype / head dim / --attention-backend gets (pure);
- zero-padding the head dim with the true dim's softmax scale: outputs and gradients equal the
  unpadded ones (SDPA standing in for the kernel);
- the index math of the FA4 path (CP's query chunks, packed documents' cu_seqlens cut to them, the
  varlen entry) against torch SDPA with the block mask, through a small pure-torch stand-in with
  flash-attn-4's call signatures (the plumbing is verified here, the kernel's numbers by
  benchmarks/gpu_fa4_check.sh on a GPU).
"""

import collections
import json
import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnBackend
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hetero.models import attention, attention_kernels, varlen
from megatron_hetero.models.attention import (
    attend,
    chunk_cu_seqlens,
    document_cu_seqlens,
    packed_seq_params,
    query_chunks,
)
from megatron_hetero.models.attention_kernels import (
    FA4,
    SDPA,
    SHORT_SEGMENTS,
    TORCH_FLASH,
    TRITON_SHORT,
    AttentionKernelError,
    Device,
    Fa4,
    KernelChoice,
    TorchFlash,
    checked_head_dims,
    choose_kernel,
    run_fa4,
)
from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.models.kernel_policy import (
    CHECKED_ENV,
    SHORT_ATTENTION_ENV,
    KernelModeError,
    KernelPolicy,
    backend_mode,
    build,
)
from megatron_hetero.models.transfer import to_device
from megatron_hetero.models.varlen import VarlenPlan, plans_to, varlen_attention
from tests.hopper import hopper_cubin
from tests.interpreter import run_on_interpreter
from tests.test_fa4_backward import Patched, Release

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0))
H100_DIMS = attention_kernels.CHECKED_HEAD_DIMS[H100.name]
# The head dims whose gradients flash-attn-4 4.0.0b36's own backward gets right on Hopper (GPU-KERNELS.md):
# the choice's tests take them for the H100, whatever the shipped table lists for it.
RELEASED_DIMS = (64, 96, 128)


# ---- the choice (pure) ----------------------------------------------------------------------------
def _choose(mode, head_dim, device=H100, **kwargs):
    kwargs.setdefault("checked", RELEASED_DIMS if device == H100 else
                      checked_head_dims(device, KernelPolicy()) if device.capability else ())
    return choose_kernel(mode, head_dim, device, **kwargs)


def test_backend_mode_is_megatrons_attention_backend():
    assert [backend_mode(b) for b in AttnBackend] == ["flash", SDPA, SDPA, SDPA, "auto"]
    assert backend_mode("auto") == "auto"
    with pytest.raises(AttentionKernelError, match="--attention-backend cudnn: use one of"):
        backend_mode("cudnn")


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_auto_takes_fa4_at_the_checked_head_dims(head_dim):
    assert _choose("auto", head_dim) == KernelChoice(FA4, head_dim, head_dim)
    assert str(_choose("auto", head_dim)) == f"fa4 (head dim {head_dim})"


@pytest.mark.parametrize("head_dim, padded", [(72, 96), (80, 96), (32, 64), (100, 128)])
def test_unchecked_head_dims_sdpa_under_auto_padded_under_flash(head_dim, padded):
    """GPU-KERNELS.md: the released FA4's gradients are wrong at 72 and 80 on the H100 and padding does not
    pay."""
    auto = _choose("auto", head_dim)
    assert auto.kernel == SDPA and "not among the head dims checked on NVIDIA H100" in auto.reason
    assert _choose("flash", head_dim) == KernelChoice(FA4, head_dim, padded)
    assert str(_choose("flash", head_dim)) == f"fa4 (head dim {head_dim} zero-padded to {padded})"


@pytest.mark.parametrize("head_dim, padded", [(72, 96), (80, 96), (32, 64)])
def test_packed_calls_are_padded_under_auto(head_dim, padded):
    """A packed (varlen) call on SDPA is one launch per segment shape: auto pads an unchecked head dim
    to a checked one there (exact), as flash does; never on a CPU, never above every checked dim."""
    assert _choose("auto", head_dim, packed=True) == KernelChoice(FA4, head_dim, padded)
    assert _choose("auto", head_dim, Device("cpu"), packed=True) == KernelChoice(SDPA, head_dim, head_dim, "no GPU",
                                                                                 merged_chunks=True)
    assert _choose("auto", 256, packed=True).kernel == SDPA
    assert _choose("sdpa", head_dim, packed=True).kernel == SDPA
    assert attention_kernels.kernel_for(KernelPolicy(), head_dim, torch.bfloat16, packed=True).kernel == SDPA


def test_short_packed_segments_take_torch_flash_at_the_true_head_dim():
    """Windows (packed calls whose segments are all short) run torch's varlen flash-attention unpadded
    under auto where it runs; whole items, flash, the SDPA backends, CPUs and what the kernel does not
    take keep the choice above."""
    mode, short = "auto", dict(packed=True, longest=SHORT_SEGMENTS, torch_flash=True)
    choice = _choose(mode, 80, **short)
    assert choice == KernelChoice(TORCH_FLASH, 80, 80, f"segments of at most {SHORT_SEGMENTS} tokens")
    assert str(choice) == f"torch flash varlen (head dim 80: segments of at most {SHORT_SEGMENTS} tokens)"
    assert _choose(mode, 80, **dict(short, longest=SHORT_SEGMENTS + 1)) == _choose(mode, 80, packed=True)
    assert _choose("flash", 80, **short) == KernelChoice(FA4, 80, 96)
    assert _choose(SDPA, 80, **short) == _choose(SDPA, 80, packed=True)
    for device, kwargs in ((Device("cpu"), {}), (Device("NVIDIA T4", (7, 5)), {}), (H100, {"torch_flash": False}),
                           (H100, {"dtype": torch.float32}), (H100, {"dropout": 0.1})):
        assert _choose(mode, 80, device, **{**short, **kwargs}).kernel != TORCH_FLASH
    for head_dim in (36, 264):  # the kernel's head dims: multiples of 8 up to 256
        assert _choose(mode, head_dim, **short).kernel != TORCH_FLASH
    assert attention_kernels.kernel_for(KernelPolicy(), 80, torch.bfloat16, packed=True, longest=64).kernel == SDPA


def test_sdpa_backends_never_take_fa4():
    for name in ("fused", "unfused", "local"):
        assert _choose(backend_mode(name), 128).kernel == SDPA


@pytest.mark.parametrize("device, kwargs, reason", [
    (Device("cpu"), {}, "no GPU"),
    (Device("NVIDIA A100-SXM4-80GB", (8, 0)), {}, "targets sm90/sm100"),
    (Device("NVIDIA B200", (10, 0)), {}, "not checked on NVIDIA B200: run `megatron-hetero kernels check attention"),
    (H100, {"import_problem": "flash-attn-4 does not import (ImportError: x)"}, "does not import"),
    (H100, {"dtype": torch.float32}, "runs bf16/fp16, not float32"),
    (H100, {"dropout": 0.1}, "attention dropout 0.1"),
    (H100, {"flash_attention_version": 3}, "--flash-attention-version 3"),
])
def test_why_not_fa4(device, kwargs, reason):
    """auto falls back to SDPA and says why; flash refuses with the same reason in one line."""
    choice = _choose("auto", 128, device, **kwargs)
    assert choice.kernel == SDPA and reason in choice.reason and reason in str(choice)
    refusal = "--attention-backend flash: head dim 128: .*" + reason.split(":")[0]
    with pytest.raises(AttentionKernelError, match=refusal):
        _choose("flash", 128, device, **kwargs)


def test_flash_refuses_a_head_dim_above_every_checked_one():
    with pytest.raises(AttentionKernelError, match="head dim 256: not among the head dims checked"):
        _choose("flash", 256)


def test_checked_head_dims_table_and_environment():
    b200 = Device("NVIDIA B200", (10, 0))
    assert checked_head_dims(H100, build(environ={})) == H100_DIMS
    assert checked_head_dims(b200, build(environ={})) == ()
    assert checked_head_dims(b200, build(environ={CHECKED_ENV: "128,64"})) == (64, 128)
    assert checked_head_dims(H100, build(environ={CHECKED_ENV: "80"})) == tuple(sorted({*H100_DIMS, 80}))
    assert _choose("auto", 128, b200, checked=(64, 128)).kernel == FA4


def test_hopper_drops_72_and_80_where_its_backward_is_unfixed(monkeypatch):
    """A check passed 72 and 80 with patches/fa4_backward.py's fix; where the installed Hopper backward
    rounds to 16 unwrapped (the patch could not apply), they are not taken on Hopper; Blackwell's backward
    is another kernel."""
    policy = build(environ={CHECKED_ENV: "72,80"})
    b200 = Device("NVIDIA B200", (10, 0))
    monkeypatch.setattr(attention_kernels, "sm90_backward_class", lambda: Release)
    assert attention_kernels.sm90_dq_wrong_off_32()
    assert checked_head_dims(H100, policy) == tuple(d for d in sorted({*H100_DIMS, 72, 80}) if d % 32 == 0)
    assert checked_head_dims(b200, policy) == (72, 80)
    monkeypatch.setattr(attention_kernels, "sm90_backward_class", lambda: Patched)  # wrapped, as replace() does
    assert not attention_kernels.sm90_dq_wrong_off_32()
    assert checked_head_dims(H100, policy) == tuple(sorted({*H100_DIMS, 72, 80}))
    monkeypatch.setattr(attention_kernels, "sm90_backward_class", lambda: None)  # no flash-attn-4
    assert not attention_kernels.sm90_dq_wrong_off_32()


def test_kernel_for_on_cpu_is_sdpa_whatever_the_flag():
    """CPU and CI: SDPA; an explicit flash on a machine without a GPU is one line."""
    assert attention_kernels.kernel_for(KernelPolicy(), 16, torch.bfloat16) == KernelChoice(SDPA, 16, 16, "no GPU",
                                                                                            merged_chunks=True)
    with pytest.raises(AttentionKernelError, match="flash: head dim 16: no GPU"):
        attention_kernels.kernel_for(KernelPolicy("flash"), 16, torch.bfloat16)


# ---- a pure-torch stand-in with flash-attn-4's signatures ------------------------------------------
def _reference(q, k, v, scale, causal):
    """One sequence: q [lq, h, d], k, v [lk, hk, d]; causal bottom-right aligned (flash-attention's);
    computed in fp32 at least, as the kernel accumulates."""
    dtype = q.dtype
    q, k, v = (t.to(torch.promote_types(dtype, torch.float32)) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(dtype)


def _dense_reference(q, k, v, softmax_scale, causal):
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[0] == k.shape[0]
    return torch.stack([_reference(*x, softmax_scale, causal) for x in zip(q, k, v)])


def fake_fwd(q, k, v, *, softmax_scale, causal, out, return_lse):
    """flash_attn.cute.interface._flash_attn_fwd: [b, s, h, d] in, written into `out` (which must have
    q's strides: Fa4.func's contract), (out, lse, p, row_max, o_lo) out."""
    assert out.shape == q.shape and out.stride() == q.stride() and return_lse
    out.copy_(_dense_reference(q, k, v, softmax_scale, causal))
    return out, torch.zeros(q.shape[:3]), None, None, None


def fake_bwd(q, k, v, out, dout, lse, softmax_scale, causal):
    """flash_attn.cute.interface._flash_attn_bwd: dq, dk, dv of the reference, each in its input's layout."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad(_dense_reference(*leaves, softmax_scale, causal), leaves, dout)
    return tuple(torch.empty_like(t).copy_(g) for t, g in zip((q, k, v), grads))


def fake_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """flash_attn.cute.flash_attn_varlen_func: [total, h, d] in, (out, lse) out; checks the contract."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and len(cu_seqlens_q) == len(cu_seqlens_k)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert cu_q[0] == cu_k[0] == 0 and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    outs = []
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        assert 0 <= b - a <= max_seqlen_q and 0 <= d - c <= max_seqlen_k
        if b > a:
            assert d > c, "queries without keys"
            outs.append(_reference(q[a:b], k[c:d], v[c:d], softmax_scale, causal))
    return torch.cat(outs), None


def fake_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug_mask, *, scale):
    """aten._flash_attention_forward's varlen call: (out, lse, rng state, unused, debug mask)."""
    assert dropout_p == 0 and not return_debug_mask
    out = fake_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                           softmax_scale=scale, causal=causal)[0]
    return out, torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2), torch.zeros(()), torch.zeros(0)


def fake_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, unused, *, scale):
    """aten._flash_attention_backward: dq, dk, dv."""
    assert out.shape == dout.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and dout.is_contiguous()
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        forward = fake_flash_fwd(*leaves, cu_q, cu_k, max_q, max_k, dropout_p, causal, False, scale=scale)[0]
        return torch.autograd.grad(forward, leaves, dout)


FAKE = Fa4(fake_fwd, fake_bwd, fake_varlen_func)
FAKE_TORCH_FLASH = TorchFlash(fake_flash_fwd, fake_flash_bwd)
SD = KernelChoice(SDPA, 8, 8)


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _grads(fn, leaves, seed=1):
    """fn's output and the gradients of the leaves under a fixed random output gradient."""
    for x in leaves:
        x.grad = None
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * g).sum().backward()
    return [out.detach()] + [x.grad.clone() for x in leaves]


def _assert_same(got, want, tol=1e-10):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"tensor {i}: {m}")


# ---- zero-padding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim, padded", [(72, 96), (72, 128), (80, 96), (80, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_padding_is_exact(head_dim, padded, causal):
    """q, k, v padded to the checked head dim with the true dim's scale: outputs and dq/dk/dv equal
    the unpadded attention's (SDPA standing in for the kernel)."""
    leaves = _leaves((2, 24, 4, head_dim), (2, 24, 2, head_dim), (2, 24, 2, head_dim))
    scale = head_dim**-0.5

    def sdpa_like_fa4(q, k, v, *, softmax_scale, causal):  # FA4's layout and tuple return, on SDPA
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2), None

    padded_run = _grads(lambda: run_fa4(sdpa_like_fa4, KernelChoice(FA4, head_dim, padded), *leaves,
                                        softmax_scale=scale, causal=causal), leaves)
    plain = _grads(lambda: sdpa_like_fa4(*leaves, softmax_scale=scale, causal=causal)[0], leaves)
    assert padded_run[0].shape[-1] == head_dim
    _assert_same(padded_run, plain)


# ---- the FA4 path's index math against SDPA with the block mask ------------------------------------
def test_document_boundaries():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [2, 2, 3, 3, 3, 3, 3, 4]])
    assert document_cu_seqlens(documents).tolist() == [0, 3, 5, 8, 10, 15, 16]  # a row starts a document
    cu = document_cu_seqlens(documents)
    assert [t.tolist() for t in chunk_cu_seqlens(cu, 8, 0, 8)] == [cu.tolist()] * 2
    # chunk 2:4 of each row: documents' queries there, their keys from their start to position 4
    assert [t.tolist() for t in chunk_cu_seqlens(cu, 8, 2, 4)] == [[0, 1, 2, 2, 2, 4, 4], [0, 3, 4, 4, 6, 8, 8]]
    params = packed_seq_params(documents, "cpu")
    assert params.cu_seqlens_q.tolist() == cu.tolist() and params.max_seqlen_q == 8
    assert query_chunks(8, 2, 1) == [((0, 2), 2, 4), ((2, 4), 4, 6)]


DOCUMENTS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2,  # row 0: documents across CP chunk borders
                          [3] * 16])  # row 1: one document


def _cp_run(kernel, fa4, cp, q, k, v, causal=True, packed=None):
    """attend over every CP rank's queries (k, v as the gather leaves them): the ranks' outputs in
    sequence order [s, b, h * d]."""
    s = q.shape[0]
    out = torch.empty(s, q.shape[1], q.shape[2] * v.shape[3], dtype=q.dtype)
    for rank in range(cp):
        at = cp_positions(s, cp, rank)
        out = out.index_put((at,), attend(q[at], k, v, kernel, q.shape[-1] ** -0.5, causal, packed=packed,
                                          cp=cp, cp_rank=rank, fa4=fa4))
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("run_head_dim", [8, 16])
def test_fa4_path_equals_sdpa(cp, packed, run_head_dim):
    """Causal attention with GQA over CP ranks (each rank's query chunks against the gathered keys),
    packed or not, on the FA4 path (stand-in kernel, padded where run_head_dim > 8) equals the SDPA
    path of one process (document mask): outputs and gradients."""
    leaves = _leaves((16, 2, 4, 8), (16, 2, 2, 8), (16, 2, 2, 8))
    params = packed_seq_params(DOCUMENTS, "cpu") if packed else None
    fa4 = KernelChoice(FA4, 8, run_head_dim)
    got = _grads(lambda: _cp_run(fa4, FAKE, cp, *leaves, packed=params), leaves)
    want = _grads(lambda: _cp_run(SD, None, 1, *leaves, packed=params), leaves)
    _assert_same(got, want)


def test_fa4_path_full_attention():
    """Encoders: full attention (no mask) on the FA4 path equals SDPA's."""
    leaves = _leaves((12, 3, 4, 8), (12, 3, 4, 8), (12, 3, 4, 8))
    got = _grads(lambda: attend(*leaves, KernelChoice(FA4, 8, 16), 0.3, False, fa4=FAKE), leaves)
    want = _grads(lambda: attend(*leaves, SD, 0.3, False), leaves)
    _assert_same(got, want)


@pytest.mark.parametrize("causal, cp", [(False, 1), (True, 1), (True, 2)])
def test_fa4_dense_output_is_a_dense_matrix(causal, cp):
    """Unpadded dense calls hand the output projection a contiguous [s, b, h * d] (FA4 writes in the
    queries' [s, b] memory order; CP's two chunks join along s): no copy in its forward or weight
    gradient. fake_fwd checks that the output it is given has q's strides."""
    q, k, v = _leaves((16, 2, 4, 8), (16, 2, 2, 8), (16, 2, 2, 8))
    for rank in range(cp):
        at = cp_positions(16, cp, rank)
        out = attend(q[at], k, v, KernelChoice(FA4, 8, 8), 0.3, causal, cp=cp, cp_rank=rank, fa4=FAKE)
        assert out.shape == (16 // cp, 2, 32) and out.is_contiguous()


def test_packed_documents_do_not_see_each_other():
    """The SDPA reference itself: a document's outputs are those of the document alone."""
    q, k, v = (x.detach() for x in _leaves((16, 2, 4, 8), (16, 2, 2, 8), (16, 2, 2, 8)))
    out = attend(q, k, v, SD, 8**-0.5, True, packed=packed_seq_params(DOCUMENTS, "cpu"))
    alone = attend(q[5:14, :1], k[5:14, :1], v[5:14, :1], SD, 8**-0.5, True)
    torch.testing.assert_close(out[5:14, :1], alone, rtol=1e-12, atol=1e-12)


def test_short_segments_take_the_triton_kernel_where_checked_or_asked():
    """Under auto, short segments run our Triton kernel where this GPU passed its check or
    MEGATRON_HETERO_SHORT_ATTENTION=triton asks for it, else torch's varlen flash-attention (=torch:
    always); where the Triton kernel cannot run (no Triton, CPUs, fp32, dropout, head dims above 128)
    and for longer segments, the choice without it."""
    short, limit = dict(packed=True, longest=SHORT_SEGMENTS, torch_flash=True, triton=True), \
        f"segments of at most {SHORT_SEGMENTS} tokens"
    assert _choose("auto", 80, **short) == KernelChoice(TORCH_FLASH, 80, 80, limit)  # not checked on this GPU
    checked = _choose("auto", 80, **short, short_checked=True)
    assert checked == KernelChoice(TRITON_SHORT, 80, 80, f"{limit}, checked on {H100.name}")
    assert str(checked) == f"triton short segments (head dim 80: {limit}, checked on {H100.name})"
    assert _choose("auto", 80, **short, short_mode="triton") == \
        KernelChoice(TRITON_SHORT, 80, 80, f"{limit}, {SHORT_ATTENTION_ENV}=triton")
    assert _choose("auto", 80, **short, short_checked=True, short_mode="torch").kernel == TORCH_FLASH
    for kwargs in ({"triton": False}, {"dtype": torch.float32}, {"dropout": 0.1}, {"longest": SHORT_SEGMENTS + 1}):
        assert _choose("auto", 80, **{**short, "short_mode": "triton", **kwargs}).kernel != TRITON_SHORT
    assert _choose("auto", 160, **short, short_mode="triton").kernel == TORCH_FLASH
    assert _choose("auto", 80, Device("cpu"), **short, short_mode="triton").kernel == SDPA
    assert _choose("flash", 80, **short, short_checked=True) == KernelChoice(FA4, 80, 96)
    assert build(environ={SHORT_ATTENTION_ENV: "triton"}).short_attention == "triton"
    with pytest.raises(KernelModeError, match=f"{SHORT_ATTENTION_ENV}=flash: use one of auto, torch, triton"):
        build(environ={SHORT_ATTENTION_ENV: "flash"})


def test_short_attention_kernel_matches_fp64_attention():
    """The Triton kernel for short segments on Triton's CPU interpreter (tests/short_attention_script.py,
    in a process of its own: the interpreter must be on before Triton is imported), forward and
    backward, fp32 and fp16, causal or not, against fp64 attention; and varlen_attention's Triton path
    against its SDPA path."""
    pytest.importorskip("triton")
    errors = run_on_interpreter("short_attention_script", timeout=600)
    assert len(errors) == 10
    for case, errs in errors.items():
        tolerance = 2e-3 if "float16" in case else 1e-5
        assert max(errs) < tolerance, (case, errs)


@pytest.mark.parametrize("causal", [False, True])
def test_short_attention_kernels_compile_for_hopper(causal):
    """Both Triton kernels compile to sm90 code (Triton's own ptxas, no GPU needed) at the windows' tile
    (64 tokens x head dims up to 128) in bf16: what the CPU interpreter cannot see."""
    from megatron_hetero.models import short_attention

    constexprs = {"BLOCK": 64, "BLOCK_D": 128, "CAUSAL": causal}
    for kernel in (short_attention._forward_kernel, short_attention._backward_kernel):
        signature = {name: "*fp32" if name == "lse_ptr" else "*bf16" if name.endswith("_ptr") else "*i32"
                     if name.startswith("cu_") else "fp32" if name == "scale" else "i32"
                     for name in kernel.arg_names if name not in constexprs}
        assert hopper_cubin(kernel, signature, constexprs, num_warps=short_attention.WARPS[0]), kernel


# ---- varlen_attention (packed images of a native-resolution ViT) -----------------------------------
# Segments of several lengths, some repeated (one batched SDPA call per shape) and interleaved so that
# the tokens must be permuted, keys longer than queries, one segment without queries.
VARLEN_Q, VARLEN_K = [3, 5, 3, 7, 0, 5, 3], [3, 6, 3, 7, 2, 5, 4]


def _cu(lengths):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attention_sdpa_and_fa4_paths(causal):
    """GQA, causal or not: the SDPA path and the FA4 path (stand-in, padded) against the reference."""
    cu_q, cu_k = _cu(VARLEN_Q), _cu(VARLEN_K)
    plan = VarlenPlan.of(cu_q, cu_k)
    assert plan.groups == ((0, 2, 1), (3, 3, 2), (3, 4, 1), (5, 5, 1), (5, 6, 1), (7, 7, 1))
    leaves = _leaves((sum(VARLEN_Q), 4, 8), (sum(VARLEN_K), 2, 8), (sum(VARLEN_K), 2, 8))
    want = _grads(lambda: fake_varlen_func(*leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                           max_seqlen_k=7, softmax_scale=0.3, causal=causal)[0], leaves)
    _assert_same(_grads(lambda: varlen_attention(*leaves, plan, SD, 0.3, causal), leaves), want)
    _assert_same(_grads(lambda: varlen_attention(*leaves, plan, KernelChoice(FA4, 8, 16), 0.3, causal, fa4=FAKE),
                        leaves), want)
    torch_flash = KernelChoice(TORCH_FLASH, 8, 8)
    _assert_same(_grads(lambda: varlen_attention(*leaves, plan, torch_flash, 0.3, causal, torch_flash=FAKE_TORCH_FLASH),
                        leaves), want)


def test_varlen_plan_permutes_only_where_shapes_interleave():
    """Segments already grouped by shape need no permutation; the keys share the queries' plan."""
    plan = VarlenPlan.of(_cu([4, 4, 9]))
    assert plan.order_q is None and plan.cu_k is plan.cu_q and (plan.max_q, plan.groups) == (9, ((4, 4, 2), (9, 9, 1)))
    plan = VarlenPlan.of(_cu([4, 9, 4]))
    assert plan.order_k is plan.order_q and plan.order_q.tolist() == [*range(4), *range(13, 17), *range(4, 13)]
    assert plan.order_q[plan.inverse_q].tolist() == list(range(17))


def test_varlen_attention_default_scale_is_the_head_dims():
    q, k, v = (x.detach() for x in _leaves((6, 2, 8), (6, 2, 8), (6, 2, 8)))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    torch.testing.assert_close(varlen_attention(q, k, v, VarlenPlan.of(cu), SD),
                               fake_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4,
                                                max_seqlen_k=4, softmax_scale=1 / math.sqrt(8), causal=False)[0])


def test_to_device_packs_any_dtypes_into_one_copy():
    tensors = [torch.arange(5, dtype=torch.int32), torch.rand(3, 2), torch.arange(7).view(7, 1), torch.ones(0)]
    moved = to_device(tensors, "cpu")
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # one buffer
    for a, b in zip(moved, tensors):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _AtenOps(TorchDispatchMode):
    """The aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_varlen_layer_has_no_host_work():
    """A layer's attention, forward and backward, on a plan made before it: on meta tensors (any read
    of a value on the host, .item(), .tolist(), .cpu() or nonzero, raises there), and on the host,
    counting ops: no copies between devices, no fills, no index_put; one SDPA call per shape."""
    cu_q, cu_k = _cu(VARLEN_Q), _cu(VARLEN_K)
    for device in ("meta", "cpu"):
        plan, _ = plans_to(device, [VarlenPlan.of(cu_q, cu_k)])
        leaves = [torch.randn(s, device=device, requires_grad=True)
                  for s in ((sum(VARLEN_Q), 4, 8), (sum(VARLEN_K), 2, 8), (sum(VARLEN_K), 2, 8))]
        with _AtenOps() as counted:
            varlen_attention(*leaves, plan[0], SD, 0.3).sum().backward()
    ops = counted.ops
    assert not {"_to_copy", "copy_", "fill_", "zero_", "index_put", "index_put_", "_local_scalar_dense"} & set(ops)
    assert ops["_scaled_dot_product_flash_attention_for_cpu"] == len(VARLEN_Q) - 2  # 7 segments, 5 shapes + empty
    assert ops["index_select"] == 3 + 1 + 1 + 3  # q, k, v and the output, forward and backward


# ---- the module ----------------------------------------------------------------------------------
def test_module_on_the_fa4_path(monkeypatch):
    """SDPAttention with the FA4 choice ([s, b, heads, d] in, [s, b, heads * d] out, GQA, causal) gives
    SDPA's outputs and gradients; the start-up summary names each module's choice."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hetero.models.vlm import transformer_config

    config = transformer_config(32, 1, 4, 1, torch.float64, num_query_groups=2)
    no_cp = SimpleNamespace(cp=None)  # the module reads only its CP group
    ours = attention.SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=no_cp)
    assert attention.attention_summary(torch.nn.ModuleDict({"core_attention": ours})) == "sdpa (head dim 8: no GPU)"
    with_cp = attention.SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(
        cp=SimpleNamespace(size=lambda: 2)))
    assert attention.attention_summary(torch.nn.ModuleDict({"core_attention": with_cp})) == (
        "sdpa (head dim 8: no GPU), CP chunks as merged calls")
    leaves = _leaves((16, 2, 4, 8), (16, 2, 2, 8), (16, 2, 2, 8))
    want = _grads(lambda: ours(*leaves, None), leaves)
    monkeypatch.setattr(attention, "load_fa4", lambda: (FAKE, None))
    ours.kernel = KernelChoice(FA4, 8, 16)
    _assert_same(_grads(lambda: ours(*leaves, None), leaves), want)


# ---- `kernels check attention`'s measuring, on CPU ---------------------------------------------------
class _DoubledGradient(torch.autograd.Function):
    """The identity whose backward doubles the gradient: a kernel with a right forward and a wrong
    backward, as flash-attn-4 4.0.0b36 at head dims 72 and 80 on the H100."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _wrong_backward(fa4: Fa4) -> Fa4:
    """The stand-in with every backward doubling its gradients (the dense kernel's and varlen's)."""
    def varlen(q, k, v, **kwargs):
        out, lse = fa4.varlen_func(q, k, v, **kwargs)
        return _DoubledGradient.apply(out), lse
    return Fa4(fa4.fwd, lambda *args: [2 * g for g in fa4.bwd(*args)], varlen)


def _check_tool(monkeypatch):
    from megatron_hetero.cli.checks import attention as check

    monkeypatch.setattr(check, "DEVICE", "cpu")
    return check


def test_gpu_check_passes_right_kernels_and_fails_a_wrong_backward(monkeypatch):
    """The GPU script's cases (causal GQA, full, packed images, CP2 halves with packed documents) in
    bf16 against its fp32 reference: SDPA and the FA4 path with a right stand-in pass; a stand-in whose
    forward is right and backward wrong fails on dq/dk/dv, not on the output."""
    tool = _check_tool(monkeypatch)
    cases = [tool.dense_case("causal gqa", 1, 32, 4, 2, 8, True), tool.dense_case("full", 3, 12, 2, 2, 8, False),
             tool.varlen_case("images", [5, 9, 3, 9], 2, 8),
             tool.cp_case("cp2 documents", 2, 32, 4, 2, 8, 2, tool._documents(2, 32, [[10, 22], [32]]))]
    for module in (attention, varlen):
        monkeypatch.setattr(module, "load_fa4", lambda: (FAKE, None))
    for case in cases:
        for kernel in (KernelChoice(SDPA, 8, 8), KernelChoice(FA4, 8, 8), KernelChoice(FA4, 8, 16)):
            record = tool.measure(case, "test", kernel, iters=0)
            assert record["ok"], record
    for module in (attention, varlen):
        monkeypatch.setattr(module, "load_fa4", lambda: (_wrong_backward(FAKE), None))
    for case in cases:
        record = tool.measure(case, "test", KernelChoice(FA4, 8, 8), iters=0)
        assert record["out_err"] < tool.TOLERANCE and min(record[f"d{x}_err"] for x in "qkv") > 0.5, record
        assert not record["ok"]


def test_gpu_check_compares_two_loss_curves(tmp_path, capsys):
    import compare_losses as tool  # benchmarks/compare_losses.py, on the path (conftest.py)

    for name, losses in (("sdpa", [2.0, 1.5, 1.25]), ("fa4", [2.0, 1.5, 1.5])):
        lines = [json.dumps({"step": i + 1, "loss": x}) for i, x in enumerate(losses)] + ['{"caption_accuracy": 1}']
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    assert tool.compare_losses(str(tmp_path / "sdpa.jsonl"), str(tmp_path / "fa4.jsonl")) == 0
    out = capsys.readouterr().out
    assert "| 3 | 1.25000 | 1.50000 | +0.25000 |" in out
    assert "3 steps: max |difference| 0.25000 (step 3)" in out


def test_loss_runs_report_places_each_run_among_the_unfused_ones(tmp_path):
    """gpu_loss_run.sh's compare.md (compare_losses.py --runs): each run against its seed's first unfused
    run (signed means of the last steps) and, step by step, below / inside / above the unfused runs'
    range (an unfused run: the other ones'), over the first TAIL steps and after; fp32 runs get a table of
    their own, each bf16 run's mean absolute distance to fp32 beside the others'."""
    import compare_losses as tool

    steps = tool.TAIL + 10
    curves = {"unfused_s1_a": 1.0, "unfused_s1_b": 1.1, "unfused_s1_c": 1.2, "fused_s1": 1.3, "fused_s2": 1.0}
    for name, level in curves.items():
        losses = [level + (0.5 if i < tool.TAIL and name == "fused_s1" else 0.0) - (0.3 if name == "unfused_s1_b" and
                  i >= tool.TAIL else 0.0) for i in range(steps)]
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"losses": losses}) + "\n")
    report = tool.runs_report(str(tmp_path))
    row = f"| 1 | fused_s1 vs unfused_s1_a | {steps} | 8.00e-01 | 3.00e-01 | +7.00e-01 | 8.00e-01 | 7.17e-01 |"
    assert row in report
    assert "| 1 | fused_s1 | 3 unfused | 0% / 0% / 100% | 0% / 0% / 100% |" in report
    assert "| 1 | unfused_s1_b | 2 unfused | 0% / 100% / 0% | 100% / 0% / 0% |" in report
    assert "| 2 | no unfused run |" in report and "fp32" not in report
    (tmp_path / "fp32_s1.jsonl").write_text(json.dumps({"losses": [0.9] * steps}) + "\n")
    report = tool.runs_report(str(tmp_path)).split("fp32 weights and compute")[1]
    for row in (f"| 1 | unfused_s1_a vs fp32_s1 | {steps} | 1.11e-01 | 1.11e-01 | +1.11e-01 | 1.00e-01 | 1.00e-01 |",
                f"| 1 | fused_s1 vs fp32_s1 | {steps} | 1.00e+00 | 4.44e-01 | +8.89e-01 | 9.00e-01 | 8.17e-01 |"):
        assert row in report


class _Group:
    """A CP group's size and rank, as CPSplit reads them."""

    def __init__(self, size, rank):
        self.size, self.rank = (lambda: size), (lambda: rank)


def test_cp_split_of_packed_items_attends_as_the_whole():
    """Items of 3 and 5 merge blocks (2 tokens each) in a layers' order that interleaves them (as
    windows do), over CP 2 (uneven parts): each rank holds item i's blocks [c*B//2, (c+1)*B//2), the
    ranks' padded parts gathered and indexed are every token in the layers' order, and each rank's
    queries attending within its segments (items, and windows that the split cuts) give the whole
    sequence's outputs at its tokens."""
    from megatron_hetero.models.varlen import CPSplit

    counts, unit, cp = torch.tensor([3, 5]), 2, 2
    order = torch.tensor([0, 3, 1, 4, 2, 5, 6, 7])  # blocks in the layers' order
    q, k, v = _leaves((16, 2, 8), (16, 2, 8), (16, 2, 8))
    for cu in (torch.tensor([0, 16]), torch.tensor([0, 4, 10, 16])):  # one segment; three cut by the split
        whole = varlen_attention(q, k, v, VarlenPlan.of(cu), SD)
        splits = [CPSplit.of(counts, order, unit, _Group(cp, r)) for r in range(cp)]
        assert sorted(torch.cat([s.blocks for s in splits]).tolist()) == list(range(8))
        assert sorted(splits[1].blocks.tolist()) == [1, 2, 5, 6, 7]  # item 0: blocks 1-2; item 1: 5-7
        parts = [torch.arange(16)[s.local] for s in splits]  # each rank's tokens, in the layers' order
        padded = torch.cat([F.pad(p, (0, splits[0].padded - len(p)), value=-1) for p in parts])
        assert torch.equal(padded[splits[0].key_index], torch.arange(16))
        for s, mine in zip(splits, parts):
            out = varlen_attention(q[mine], k, v, VarlenPlan.of(s.local_cu(cu), cu), SD)
            torch.testing.assert_close(out, whole[mine], rtol=1e-12, atol=1e-12)
