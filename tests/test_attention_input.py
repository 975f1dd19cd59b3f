"""The packed ViTs' attention input and the padding's cut on our Triton kernels (models/attention_input.py):
on Triton's CPU interpreter against packed_attention's functions in fp64, compiled for Hopper, on a GPU
against the compiled functions; the layer calls them under triton only, with the same results."""

import os
from unittest import mock

import pytest
import torch

from megatron_hetero.models import attention_input
from megatron_hetero.models.kernel_policy import ATTENTION_INPUT_ENV, KernelPolicyError, build
from tests.compiling import outputs_and_gradients
from tests.distributed import run_distributed
from tests.hopper import hopper_cubin
from tests.interpreter import run_on_interpreter


def test_kernels_match_the_functions_within_rounding():
    results = run_on_interpreter("attention_input_script")
    assert len(results) == 32 and all(all(checks) for checks in results.values()), results


def test_kernels_compile_for_hopper():
    """The three kernels compile to sm90 code with and without the bias and RoPE, padded and not (Triton's
    own ptxas, no GPU needed)."""
    def pointers(*names):
        return {name: "*bf16" for name in names}

    tables = ("cos_q", "sin_q", "cos_k", "sin_k")
    for has_bias, has_rope, run_dim in ((True, True, 96), (False, False, 80)):
        dims = {"HEAD_DIM": 80, "RUN_DIM": run_dim, "HALF": 64, "ROWS": attention_input.ROWS,
                "HAS_BIAS": has_bias, "HAS_ROPE": has_rope}
        assert hopper_cubin(attention_input._heads_kernel, {
            **pointers("mixed", "bias", *tables, "q", "k", "v"), "rows": "i32", "per_group": "i32"},
            {**dims, "PAD": 16})
        assert hopper_cubin(attention_input._heads_backward_kernel, {
            **pointers("dq", "dk", "dv", *tables, "dmixed"), "bias_sums": "*fp32", "rows": "i32",
            "per_group": "i32"}, dims)
    assert hopper_cubin(attention_input._copy_heads_kernel, {**pointers("src", "dst"), "rows": "i32", "heads": "i32"},
                        {"SRC_DIM": 96, "DST_DIM": 80, "BLOCK": 128, "ROWS": attention_input.ROWS})


def test_takes_gpu_calls_of_one_token_a_row_and_an_even_head_dim(monkeypatch):
    monkeypatch.setattr(attention_input, "HAVE_TRITON", True)
    mixed = torch.zeros(5, 1, 48)
    cuda = type("Cuda", (), {"is_cuda": True, "shape": mixed.shape, "dtype": mixed.dtype,
                             "is_contiguous": lambda self: True, "dim": lambda self: 3})
    fake, bias, table = cuda(), torch.zeros(48), torch.zeros(5, 1, 1, 8)
    assert attention_input.takes(fake, bias, (table,) * 4, 8) and attention_input.takes(fake, None, None, 8)
    assert not attention_input.takes(mixed, bias, None, 8)  # on the CPU
    assert not attention_input.takes(fake, bias, None, 6 + 1)  # an odd head dim
    assert not attention_input.takes(fake, torch.zeros(24), None, 8)  # not one bias value per column
    assert not attention_input.takes(fake, None, (table.half(),) * 4, 8)  # tables of another dtype
    assert not attention_input.takes(fake, None, (table.requires_grad_(),) * 4, 8)  # learnt tables
    other = cuda()
    other.shape = torch.Size([5, 2, 48])
    assert not attention_input.takes(other, None, None, 8)  # two tokens a row


def test_a_bad_mode_is_one_line():
    assert build(environ={ATTENTION_INPUT_ENV: "triton"}).attention_input == "triton"
    assert build(environ={}).attention_input == "auto"
    with pytest.raises(KernelPolicyError, match=f"^{ATTENTION_INPUT_ENV}=fused: use one of auto, torch, triton$"):
        build(environ={ATTENTION_INPUT_ENV: "fused"})


def _check_the_layer_calls_them_under_triton(rank, world_size):
    from megatron_hetero.models import packed_attention
    from megatron_hetero.models.attention import attention_summary
    from tests.test_attention_kernels import FAKE
    from tests.test_packed_attention import _env, _outputs_and_grads, _pad_heads, _tower

    calls = []
    for name in ("packed_heads", "cut_heads"):
        eager = getattr(packed_attention, name)
        setattr(attention_input, name, lambda *args, eager=eager, name=name: calls.append(name) or eager(*args))
    attention_input.takes = lambda *args: True  # the CPU's tensors, as a GPU's
    attention_input.cuts = lambda out: True
    results = {}
    for mode in ("triton", "auto", "torch"):
        os.environ[ATTENTION_INPUT_ENV] = mode
        tower, batch = _tower("qwen2_5_vl_tiny", 1, True, _env)
        _pad_heads(tower, FAKE, 0)  # padded: the cut runs
        layers = [m for m in tower.modules() if isinstance(m, packed_attention.PackedSelfAttention)]
        assert [m.on_triton for m in layers] == [mode == "triton"] * len(layers)
        with mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(attention_input, "HAVE_TRITON", True):  # as on a GPU with Triton
            said = attention_summary(tower)
        assert said.endswith(f"; {attention_input.SUMMARY}") == (mode == "triton"), said
        calls.clear()
        results[mode] = _outputs_and_grads(tower, *batch)
        assert calls == (["packed_heads", "cut_heads"] * len(layers) if mode == "triton" else [])
    for mode in ("auto", "torch"):
        assert all(torch.equal(a, b) for a, b in zip(results["triton"], results[mode], strict=True))


def test_the_layer_calls_them_under_triton_only():
    run_distributed(_check_the_layer_calls_them_under_triton, 1)


@pytest.mark.skipif(not (torch.cuda.is_available() and attention_input.HAVE_TRITON), reason="needs a GPU with Triton")
@pytest.mark.parametrize("rope, run_dim", [(True, 96), (True, 80), (False, 96)])
def test_on_a_gpu_the_kernels_match_the_compiled_functions(rope, run_dim):
    """On a GPU, bf16 at Qwen2.5-VL-7B's ViT widths: the query, key and value heads (cut where padded) within
    one rounding of the compiled functions', the gradients of the QKV output and its bias within rounding."""
    from megatron_hetero.models.packed_attention import cut_heads, packed_heads

    gen = torch.Generator(device="cuda").manual_seed(0)
    groups, head_dim, tokens = 16, 80, 4099
    width = groups * 3 * head_dim
    mixed = torch.randn(tokens, 1, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(width, device="cuda", generator=gen, dtype=torch.bfloat16)
    angles = torch.rand(tokens, 1, 1, head_dim, device="cuda", generator=gen) * 6
    rotary = (angles.cos().bfloat16(), angles.sin().bfloat16()) * 2 if rope else None
    dout = torch.randn(tokens, 1, 3 * groups * head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)

    def through(heads, cut):
        def call(mixed, bias):
            out = torch.cat(heads(mixed, bias, rotary, groups, 1, head_dim, run_dim), dim=1).flatten(1)[:, None]
            return cut(out, 3 * groups, head_dim) if run_dim > head_dim else out
        return call

    ours = outputs_and_gradients(through(attention_input.packed_heads, attention_input.cut_heads), (mixed, bias), dout)
    theirs = outputs_and_gradients(through(torch.compile(packed_heads), torch.compile(cut_heads)), (mixed, bias), dout,
                                   compiled=True)
    for mine, compiled in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.float(), compiled.float(), rtol=2**-7, atol=1e-3)
