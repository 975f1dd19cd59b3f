"""The packed encoders' attention with the work between its GEMMs fused (models/packed_attention.py)
equals megatron-core's SelfAttention bit for bit on CPUs: Qwen2.5-VL's and Qwen3-VL's vision towers
(windowed and full layers, images of several sizes in one call), outputs and every gradient, in
float64, on one process and under vision TP2, on SDPA and on the flash-attn-4 path with the head dim
zero-padded (a stand-in for flash-attn-4's varlen entry); the module keeps SelfAttention's
parameters."""

import pytest
import torch

from tests.distributed import run_distributed

FAMILIES = ("qwen2_5_vl_tiny", "qwen3_vl_tiny")


def _tower(name: str, tp: int, fused: bool, monkeypatch_env):
    """The family's tiny vision tower (float64) at TP `tp`, fused or megatron-core's forward."""
    from count_vit_ops import family_sizes, packed_batch

    from megatron_hetero.models import kernel_policy
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.spec.layout import ModuleLayout

    monkeypatch_env(kernel_policy.EAGER_ROPE_ENV, None if fused else "1")
    family, sizes, vision = family_sizes(name, 2)
    pgs = build_module_groups(ModuleLayout(f"vision_{name}_{int(fused)}", "encoder", tp=tp)).pgs
    torch.manual_seed(0)
    tower = family.build_vision(sizes, tp, pgs, torch.float64, whole=True)
    return tower, packed_batch(tower, vision)


def _env(name, value):
    import os

    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _outputs_and_grads(tower, patches, grids):
    patches = patches.double().requires_grad_()
    out = tower(patches, grids)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    return [out.detach(), patches.grad] + [p.grad for _, p in sorted(tower.named_parameters())]


def _pad_heads(tower, fa4) -> None:
    """Every attention of the tower on the flash-attn-4 path, its head dim zero-padded by 8."""
    from megatron_hetero.models import varlen
    from megatron_hetero.models.attention_kernels import FA4, KernelChoice
    from megatron_hetero.models.packed_attention import PackedSelfAttention

    varlen.load_fa4 = lambda: (fa4, None)
    for module in tower.modules():
        if isinstance(module, PackedSelfAttention):
            head_dim = module.hidden_size_per_attention_head
            module.core_attention.kernel = KernelChoice(FA4, head_dim, head_dim + 8)


def _check_fused_equals_megatrons(rank, world_size, name, padded):
    from megatron_hetero.models.packed_attention import PackedSelfAttention
    from tests.test_attention_kernels import FAKE

    towers = {fused: _tower(name, world_size, fused, _env) for fused in (True, False)}
    (fused, batch), (upstream, _) = towers[True], towers[False]
    attentions = [m for m in fused.modules() if isinstance(m, PackedSelfAttention)]
    assert attentions and all(m.fused and m.linear_qkv.skip_bias_add for m in attentions)
    assert not any(m.fused or m.linear_qkv.skip_bias_add for m in upstream.modules()
                   if isinstance(m, PackedSelfAttention))
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in upstream.named_parameters()]
    upstream.load_state_dict(fused.state_dict())
    if padded:
        for tower in (fused, upstream):
            _pad_heads(tower, FAKE)
    got, want = (_outputs_and_grads(t, *batch) for t in (fused, upstream))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("padded", [False, True], ids=["sdpa", "fa4_padded"])
def test_fused_heads_equal_megatrons_attention(name, padded):
    run_distributed(_check_fused_equals_megatrons, 1, name, padded)


def test_fused_heads_equal_megatrons_attention_under_tp2():
    run_distributed(_check_fused_equals_megatrons, 2, "qwen2_5_vl_tiny", True)


def test_fused_only_where_nothing_runs_between_the_gemms(monkeypatch):
    """Query/key norms, an output gate, interleaved or TE-fused RoPE, or the policy's eager RoPE keep
    megatron-core's forward."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models import kernel_policy
    from megatron_hetero.models.packed_attention import fuses_heads

    monkeypatch.delenv(kernel_policy.EAGER_ROPE_ENV, raising=False)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    assert fuses_heads(config)
    for field in ("qk_layernorm", "attention_output_gate", "rotary_interleaved", "apply_rope_fusion"):
        changed = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        object.__setattr__(changed, field, True)
        assert not fuses_heads(changed), field
    monkeypatch.setenv(kernel_policy.EAGER_ROPE_ENV, "1")
    assert not fuses_heads(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4))


def test_fused_heads_refuse_inference():
    """Inference (a KV cache) is megatron-core's forward's business: one line, not a wrong answer."""
    from megatron_hetero.models.packed_attention import PackedSelfAttention

    attention = PackedSelfAttention.__new__(PackedSelfAttention)
    torch.nn.Module.__init__(attention)
    attention.fused = True
    with pytest.raises(ValueError, match="not inference"):
        attention.forward(torch.zeros(4, 1, 8), None, inference_context=object())
