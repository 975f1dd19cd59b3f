"""Issue 30's fusions against the unfused path they replace, on CPUs (eagerly: the functions GPUs
compile). Tolerances: fp32 up to 1e-5 relative where the fused function reorders a sum, bf16 outputs
bit for bit where it computes what upstream does; the 1-process model check compares losses and
every gradient of a small LLM with both fusions on and off."""

import pytest
import torch
import torch.nn.functional as F

SEED = 5


def _upstream_rope():
    from megatron.core.models.common.embeddings import rope_utils

    upstream = rope_utils._apply_rotary_pos_emb_bshd
    while hasattr(upstream, "__wrapped__"):
        upstream = upstream.__wrapped__
    return upstream


def _split_path(mixed, freqs, split):
    """megatron-core's split path: torch.split, query regrouped into heads, RoPE on query and key."""
    upstream = _upstream_rope()
    query, key, value = torch.split(mixed, split, dim=3)
    query = query.reshape(query.size(0), query.size(1), -1, split[1])
    return upstream(query, freqs), upstream(key, freqs), value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_per_group", [1, 2])
def test_fused_qkv_rope_is_the_split_path(dtype, heads_per_group):
    """patches/qkv_rope.py's query, key, value equal the split path's bit for bit, and so does the one
    QKV gradient its backward writes (the split path's: the cat of dq, dk, dv), MHA and GQA."""
    from megatron_hetero.patches.qkv_rope import apply_fused_qkv_rotary_pos_emb

    gen = torch.Generator().manual_seed(SEED)
    s, b, groups, head_dim = 12, 2, 3, 16
    split = [heads_per_group * head_dim, head_dim, head_dim]
    mixed = torch.randn(s, b, groups, sum(split), generator=gen).to(dtype)
    freqs = torch.randn(s, 1, 1, head_dim, generator=gen) * 10
    results = []
    for fn in (apply_fused_qkv_rotary_pos_emb, _split_path):
        leaf = mixed.clone().requires_grad_()
        outs = fn(leaf, freqs, freqs, split) if fn is apply_fused_qkv_rotary_pos_emb else fn(leaf, freqs, split)
        cotangents = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(dtype)
                      for i, o in enumerate(outs)]
        torch.autograd.backward(outs, cotangents)
        results.append(([o.detach() for o in outs], leaf.grad))
    (fused, fused_grad), (split_outs, split_grad) = results
    assert [o.shape for o in fused] == [o.shape for o in split_outs]
    assert all(torch.equal(a, b) for a, b in zip(fused, split_outs))
    torch.testing.assert_close(fused_grad, split_grad, rtol=0, atol=0)


def test_fused_qkv_rope_partial_rotary_dim_takes_upstreams_path():
    """A rotary dim below the head dim (rotary_percent < 1): upstream's rotation, same result."""
    from megatron_hetero.patches.qkv_rope import apply_fused_qkv_rotary_pos_emb

    gen = torch.Generator().manual_seed(SEED)
    mixed = torch.randn(6, 1, 2, 3 * 8, generator=gen)
    freqs = torch.randn(6, 1, 1, 4, generator=gen)
    got = apply_fused_qkv_rotary_pos_emb(mixed, freqs, freqs, [8, 8, 8])
    assert all(torch.equal(a, b) for a, b in zip(got, _split_path(mixed, freqs, [8, 8, 8])))


def _norm_pair(rms: bool, dtype, fused: bool, monkeypatch):
    """A norm feeding a nonlinear branch whose output adds the residual back, as a layer does:
    (output, input grad, weight grad, bias grad), in fp32; inputs and weights bf16 values."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models.norm import FUSED_RESIDUAL_ENV, SequenceParallelNorm

    monkeypatch.setenv(FUSED_RESIDUAL_ENV, "1" if fused else "0")
    config = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=2,
                               normalization="RMSNorm" if rms else "LayerNorm", params_dtype=dtype)
    norm = SequenceParallelNorm(config, 24, 1e-5, residual_out=True)
    assert norm.residual_out == fused
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=gen).bfloat16())
        if norm.bias is not None:
            norm.bias.copy_(torch.randn(24, generator=gen).bfloat16())
    x = (torch.randn(10, 2, 24, generator=gen) * 3 + 1).bfloat16().to(dtype).requires_grad_()
    out = norm(x)
    normed, residual = out if fused else (out, x)
    y = F.gelu(normed) * 2 + residual
    (y * torch.linspace(-1, 1, y.numel()).view_as(y).to(dtype)).sum().backward()
    bias_grad = None if norm.bias is None else norm.bias.grad.float()
    return normed.detach().float(), x.grad.float(), norm.weight.grad.float(), bias_grad


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_is_the_unfused_norm(rms, dtype, monkeypatch):
    """models/norm.py's ResidualNorm: the same output (torch's kernel); the input gradient (the norm's
    plus the residual's, one pass), weight and bias gradients of torch's norm backward plus
    autograd's add: within 1e-5 relative in fp32 (a reordered sum); in bf16 within twice the unfused bf16
    path's distance from the fp32 computation (each rounds once per output, in another order)."""
    fused = _norm_pair(rms, dtype, True, monkeypatch)
    plain = _norm_pair(rms, dtype, False, monkeypatch)
    exact = _norm_pair(rms, torch.float32, False, monkeypatch)
    assert torch.equal(fused[0], plain[0])
    for got, want, reference in zip(fused[1:], plain[1:], exact[1:]):
        if want is None:
            assert got is None
        elif dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        else:
            assert (got - reference).abs().max() <= 2 * (want - reference).abs().max()


def test_residual_norm_off_where_the_layer_recomputes_its_norms(monkeypatch):
    """Selective recomputation of the norms checkpoints the norm alone: it keeps one output."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models.norm import FUSED_RESIDUAL_ENV, SequenceParallelNorm

    monkeypatch.setenv(FUSED_RESIDUAL_ENV, "1")
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, recompute_granularity="selective",
                               recompute_modules=["layernorm"])
    assert not SequenceParallelNorm(config, 8, residual_out=True).residual_out


def _llm_run(fused: bool):
    """Per-token losses and every parameter gradient of a small LLM (LayerNorm, GQA) built with both
    fusions on or off."""
    import os

    from megatron_hetero.groups import build_module_groups
    from megatron_hetero.layout import ModuleLayout
    from megatron_hetero.models.norm import FUSED_RESIDUAL_ENV
    from megatron_hetero.models.sizes import LLMArch, ModelSizes
    from megatron_hetero.models.vlm import build_llm, llm_forward
    from megatron_hetero.runtime.parallel_state import init_outside_training

    os.environ[FUSED_RESIDUAL_ENV] = "1" if fused else "0"
    pgs = build_module_groups(ModuleLayout(f"llm{fused}", "llm")).pgs
    sizes = ModelSizes(hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                       llm_arch=LLMArch(num_query_groups=2))
    init_outside_training(SEED, tp_rank=0)
    torch.manual_seed(SEED)
    llm = build_llm(sizes, 1, pgs, fused_single_qkv_rope=fused)
    attention = llm.decoder.layers[0].self_attention
    assert attention.config.fused_single_qkv_rope == fused
    assert llm.decoder.layers[0].input_layernorm.residual_out == fused
    assert not llm.decoder.final_layernorm.residual_out  # a block's final norm returns one tensor
    gen = torch.Generator().manual_seed(SEED)
    ids, labels = torch.randint(0, 22, (2, 16), generator=gen), torch.randint(0, 22, (2, 16), generator=gen)
    losses = llm_forward(llm, ids, torch.arange(16)[None].expand(2, -1), [], labels)
    losses.sum().backward()
    return losses.detach(), {name: p.grad for name, p in llm.named_parameters()}


def _both_llm_runs(rank, world_size):
    from megatron_hetero.patches import apply

    apply()
    return _llm_run(True), _llm_run(False)


def test_llm_with_both_fusions_is_the_unfused_llm(tmp_path):
    """A GPTModel on our spec through megatron-core's fused_single_qkv_rope path (patches/qkv_rope.py)
    and our layers' residual norms: losses and every parameter gradient as without them (fp32, 1e-5
    relative: the norm's backward sums in another order). One gloo process."""
    from tests.distributed import collect_distributed

    ((fused_losses, fused_grads), (losses, grads)), = collect_distributed(_both_llm_runs, 1, tmp_path)
    torch.testing.assert_close(fused_losses, losses, rtol=1e-6, atol=0)
    assert fused_grads.keys() == grads.keys()
    for name, want in grads.items():
        torch.testing.assert_close(fused_grads[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")
