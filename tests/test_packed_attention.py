"""The packed encoders' attention with the work between its GEMMs fused (models/packed_attention.py)
equals megatron-core's SelfAttention bit for bit on CPUs: Qwen2.5-VL's and Qwen3-VL's vision towers
(windowed and full layers, images of several sizes in one call), outputs and every gradient, in
float64, on one process and under vision TP2, on SDPA and on the flash-attn-4 path with the head dim
zero-padded (a stand-in for flash-attn-4's varlen entry); the module keeps SelfAttention's
parameters."""

import pytest
import torch

from tests.compiling import compiling
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


def _pad_heads(tower, fa4, short_segments: int) -> None:
    """Every attention of the tower on the flash-attn-4 path, its head dim zero-padded by 8; calls whose
    segments are all `short_segments` tokens or fewer on torch's varlen flash-attention (stand-ins)."""
    from megatron_hetero.models import varlen
    from megatron_hetero.models.attention_kernels import FA4, TORCH_FLASH, KernelChoice, torch_flash_varlen
    from megatron_hetero.models.packed_attention import PackedSelfAttention
    from tests.test_attention_kernels import FAKE_TORCH_FLASH

    varlen.load_fa4 = lambda: (fa4, None)
    varlen.torch_flash_varlen = lambda *args: torch_flash_varlen(*args[:-1], FAKE_TORCH_FLASH)
    varlen.SHORT_SEGMENTS = short_segments
    for module in tower.modules():
        if isinstance(module, PackedSelfAttention):
            head_dim = module.hidden_size_per_attention_head
            module.core_attention.kernel = KernelChoice(FA4, head_dim, head_dim + 8)
            module.core_attention.short_kernel = KernelChoice(TORCH_FLASH, head_dim, head_dim)


def _check_fused_equals_megatrons(rank, world_size, name, kernels):
    from megatron_hetero.models.packed_attention import PackedSelfAttention
    from megatron_hetero.models.varlen import SegmentAttention
    from tests.test_attention_kernels import FAKE

    towers = {fused: _tower(name, world_size, fused, _env) for fused in (True, False)}
    (fused, batch), (upstream, _) = towers[True], towers[False]
    attentions = [m for m in fused.modules() if isinstance(m, PackedSelfAttention)]
    assert attentions and all(m.fused and m.linear_qkv.skip_bias_add for m in attentions)
    assert not any(m.fused or m.linear_qkv.skip_bias_add for m in upstream.modules()
                   if isinstance(m, PackedSelfAttention))
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in upstream.named_parameters()]
    upstream.load_state_dict(fused.state_dict())
    if kernels != "sdpa":
        # "windows": the windows' calls short (torch's flash, unpadded), the whole images' long (FA4, padded)
        windows = max(batch_windows(fused, batch) or [0])
        for tower in (fused, upstream):
            _pad_heads(tower, FAKE, windows if kernels == "windows" else 0)
    calls = []

    def kernel_of_call(module, args, kwargs, out):
        calls.append(module.plan(kwargs["packed_seq_params"])[1].kernel)

    for module in fused.modules():
        if isinstance(module, SegmentAttention):
            module.register_forward_hook(kernel_of_call, with_kwargs=True)
    got, want = (_outputs_and_grads(t, *batch) for t in (fused, upstream))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    if kernels == "windows" and name == "qwen2_5_vl_tiny":
        assert {"torch-flash", "fa4"} == set(calls)


def batch_windows(tower, batch) -> list[int]:
    """The window lengths of the tower's packed batch (none for a tower without windows)."""
    from megatron_hetero.models.varlen import SegmentAttention

    found = []
    def hook(module, args, kwargs, out):
        windows = kwargs["packed_seq_params"].windows
        if windows is not None:
            found.append(windows.max_q)
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in tower.modules()
               if isinstance(m, SegmentAttention)]
    with torch.no_grad():
        tower(batch[0].double(), batch[1])
    for handle in handles:
        handle.remove()
    return found


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("kernels", ["sdpa", "fa4_padded", "windows"])
def test_fused_heads_equal_megatrons_attention(name, kernels):
    run_distributed(_check_fused_equals_megatrons, 1, name, kernels)


def test_fused_heads_equal_megatrons_attention_under_tp2():
    run_distributed(_check_fused_equals_megatrons, 2, "qwen2_5_vl_tiny", "windows")


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


@pytest.mark.parametrize("rope, pad", [(False, 0), (True, 0), (True, 8)], ids=["no_rope", "rope", "rope_padded"])
def test_compiled_heads_equal_eager(rope, pad):
    """packed_heads and cut_heads as GPUs run them, compiled whole (fullgraph: a graph break fails), here on
    the CPU (the tests' processes turn compile off; on here) against eager, in float64: the heads, the cut
    and the gradients of the QKV output, its bias and the rotary tables."""
    from megatron_hetero.models.packed_attention import _compiled, cut_heads, packed_heads

    groups, per_group, head_dim, tokens = 2, 2, 8, 11
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(tokens, 1, groups * (per_group + 2) * head_dim, generator=g, dtype=torch.float64),
              torch.randn(groups * (per_group + 2) * head_dim, generator=g, dtype=torch.float64)]
    leaves += [torch.randn(tokens, 1, 1, head_dim, generator=g, dtype=torch.float64) for _ in range(4 if rope else 0)]
    results = []
    for compiled in (True, False):
        mixed, bias, *tables = (t.clone().requires_grad_() for t in leaves)
        with compiling(compiled):
            heads_fn, cut_fn = (_compiled(f) if compiled else f for f in (packed_heads, cut_heads))
            q, k, v = heads_fn(mixed, bias, tuple(tables) or None, groups, per_group, head_dim, head_dim + pad)
            cut = cut_fn(q.flatten(1)[:, None], groups * per_group, head_dim)
        outputs = [q, k, v, cut]
        weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=t.dtype)
                   for i, t in enumerate(outputs)]
        sum((t * w).sum() for t, w in zip(outputs, weights, strict=True)).backward()
        results.append([t.detach() for t in outputs] + [t.grad for t in (mixed, bias, *tables)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
