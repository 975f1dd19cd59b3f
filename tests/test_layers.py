"""Layers without Transformer Engine: the CP sequence layout (pure), our SDPA attention, norm and MLP
against megatron-core's local layers (1 process), and a GPTModel on our spec under TP/CP/SP
reproducing the 1-process model (4 gloo processes, one launch for every case). The MLPs run their
fused path (the activation in the GEMMs' epilogues) on a stand-in for quack's GEMMs
(tests/quack_stand_in.py): its TP / SP communication and parameters against megatron-core's MLP."""

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.models.context_parallel import (
    contiguous_part,
    cp_gathered_to_sequence_order,
    cp_positions,
    cp_slice,
)
from tests.distributed import collect_distributed

SEED = 11
SEQ, BATCH = 16, 2
# name -> (tp, cp, dp, sp, num_query_groups, qk_norm); dp replicas all run the same batch.
CASES = {
    "tp2_cp2_sp": (2, 2, 1, True, None, False),
    "tp2_cp2_sp_gqa": (2, 2, 1, True, 2, False),
    "cp2": (1, 2, 2, False, None, False),
    "cp4_gqa": (1, 4, 1, False, 2, False),
    "tp2_sp": (2, 1, 2, True, None, False),
    "tp2_cp2_sp_gqa_qknorm": (2, 2, 1, True, 2, True),  # Qwen3's RMSNorm over each query and key head
}

# Encoder CP, full attention over the CP group: name -> (tp, cp, dp, class token, pre-norm); an
# item's tokens split into cp contiguous parts (with a class token 9 patches + 1: rows 4 and 5).
ENCODER_CASES = {
    "encoder_tp2_cp2": (2, 2, 1, False, False),
    "encoder_cp4": (1, 4, 1, False, False),
    "encoder_cp2_class_token": (1, 2, 2, True, True),
}


# ---- pure: the CP layout ------------------------------------------------------------------------
def test_cp_positions_are_megatrons_load_balanced_chunks():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    for cp in (1, 2, 4):  # every position held exactly once
        held = torch.cat([cp_positions(16, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(16))


def test_cp_slice_and_gather_order_invert_each_other():
    full = torch.arange(2 * 24).view(2, 24)
    parts = [cp_slice(full, 1, 3, r) for r in range(3)]
    assert torch.equal(parts[2], full[:, cp_positions(24, 3, 2)])
    gathered = torch.cat([p.T for p in parts])  # rank order, sequence first
    assert torch.equal(cp_gathered_to_sequence_order(gathered, 3), full.T)
    assert cp_slice(full, 1, 1, 0) is full


def test_contiguous_part_is_an_encoders_cp_layout():
    full = torch.arange(12)
    assert torch.cat([contiguous_part(full, 0, 3, r) for r in range(3)]).tolist() == full.tolist()
    assert contiguous_part(full, 0, 4, 1).tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="12 tokens do not split into cp=5"):
        contiguous_part(full, 0, 5, 0)


@pytest.mark.parametrize("seq_len, cp, cp_rank", [(10, 2, 0), (8, 2, 2), (8, 0, 0)])
def test_cp_positions_rejects_bad_layouts(seq_len, cp, cp_rank):
    with pytest.raises(ValueError):
        cp_positions(seq_len, cp, cp_rank)


def test_packed_llm_keeps_our_attention_where_te_imports(monkeypatch):
    """Packed sequences need attention kept within each sample (our SDPAttention reads seq_idx);
    with Transformer Engine importable the LLM would otherwise get TE's, which attends across them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models import kernel_policy, specs
    from megatron_hetero.models.attention import SDPAttention

    monkeypatch.setattr(kernel_policy, "HAVE_TE", True)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    assert specs.llm_uses_te(config, packed=False) and not specs.llm_uses_te(config, packed=True)
    layer = specs.llm_layer_spec(None, te=specs.llm_uses_te(config, packed=True))
    assert layer.submodules.self_attention.submodules.core_attention is SDPAttention


def test_encoder_cp_keeps_our_attention_where_te_imports(monkeypatch):
    """An encoder's CP parts run our attention (checked below against one process) even where
    Transformer Engine imports; without CP it gets TE's layers."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models import kernel_policy, specs
    from megatron_hetero.models.attention import SDPAttention

    monkeypatch.setattr(kernel_policy, "HAVE_TE", True)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    groups = {cp: SimpleNamespace(cp=SimpleNamespace(size=lambda cp=cp: cp), tp=None) for cp in (1, 2)}
    assert specs.encoder_uses_te(config, groups[1]) and not specs.encoder_uses_te(config, groups[2])
    layer = specs.encoder_layer_spec(groups[2], specs.encoder_uses_te(config, groups[2]))
    assert layer.submodules.self_attention.submodules.core_attention is SDPAttention


# ---- distributed: one launch computes (got, want) pairs for every test below ----------------------
def _sizes(qk_norm: bool):
    from megatron_hetero.spec.sizes import LLMArch, ModelSizes

    arch = LLMArch(normalization="RMSNorm", qk_norm=True) if qk_norm else LLMArch()
    return ModelSizes(hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=SEQ, llm_arch=arch)


def _inputs(hidden: int):
    """Full-sequence ids, labels, boundary slots [s, b, h] and their mask [s, b] (the positions
    that take them)."""
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 22, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, 22, (BATCH, SEQ), generator=gen)
    slots = torch.randn(SEQ, BATCH, hidden, generator=gen)
    mask = torch.rand(SEQ, BATCH, generator=gen) < 0.3
    return ids, labels, slots, mask


def _sequence_part(full: torch.Tensor, seq_dim: int, tp, cp, sp, pgs):
    """This rank's part of a full-sequence tensor: its CP chunks, then its SP part."""
    local = cp_slice(full, seq_dim, cp, pgs.cp.rank())
    return local.chunk(tp, seq_dim)[pgs.tp.rank()] if sp else local


def _run_llm(pgs, tp, cp, sp, num_query_groups, qk_norm):
    """Per-token losses, input-slot gradients and whole parameter gradients of this rank's part
    (those megatron's finalize_model_grads sums over TP, query/key norms', summed)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from megatron_hetero.models.full_state import full_tensors
    from megatron_hetero.models.vlm import build_llm, llm_forward
    from megatron_hetero.parallel.parallel_state import init_outside_training

    sizes = _sizes(qk_norm)
    init_outside_training(SEED, tp_rank=pgs.tp.rank())
    torch.manual_seed(SEED)
    llm = build_llm(sizes, tp, pgs, sp=sp, num_query_groups=num_query_groups)
    ids, labels, slots, mask = _inputs(sizes.hidden_size)
    slots = _sequence_part(slots, 0, tp, cp, sp, pgs).clone().requires_grad_()
    positions = cp_positions(SEQ, cp, pgs.cp.rank())
    at = _sequence_part(mask, 0, tp, cp, sp, pgs).reshape(-1).nonzero().squeeze(1)  # rows of [s' * b, h]
    losses = llm_forward(
        llm,
        ids[:, positions],
        positions[None].expand(BATCH, -1),
        [(slots.reshape(-1, sizes.hidden_size)[at], at)],
        labels[:, positions],
    )
    losses.sum().backward()
    for param in llm.parameters():
        dist.all_reduce(param.grad, group=pgs.cp)  # each CP rank's grads cover its positions only
        param.main_grad = param.grad
    llm.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([llm], llm.config, pgs.tp)
    return losses.detach(), slots.grad, full_tensors(llm, pgs.tp, grads=True)


def _parallel_llm_pairs(case, ref_pgs):
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.spec.layout import ModuleLayout

    tp, cp, dp, sp, groups, qk_norm = CASES[case]
    pgs = build_module_groups(ModuleLayout(case, "llm", tp=tp, cp=cp, dp=dp, sp=sp)).pgs
    losses, slot_grad, grads = _run_llm(pgs, tp, cp, sp, groups, qk_norm)
    ref_losses, ref_slot_grad, ref_grads = _run_llm(ref_pgs, 1, 1, False, groups, qk_norm)
    pairs = {
        "losses": (losses, cp_slice(ref_losses, 1, cp, pgs.cp.rank())),
        "slot_grad": (slot_grad, _sequence_part(ref_slot_grad, 0, tp, cp, sp, pgs)),
    }
    pairs.update({f"grad {name}": (grads[name], want) for name, want in ref_grads.items()})
    return pairs


def _run_encoder(pgs, tp, class_token, pre_norm):
    """This rank's rows of a vision encoder on 3 images, the images' gradient and whole parameter
    gradients (summed over CP: each CP rank's cover its part of the tokens), and the CP size its
    core attention runs."""
    from megatron_hetero.models.full_state import full_tensors
    from megatron_hetero.models.vlm import build_vision_encoder
    from megatron_hetero.parallel.parallel_state import init_outside_training
    from megatron_hetero.spec.sizes import ModelSizes, VisionArch

    arch = VisionArch(class_token=class_token, pre_norm=pre_norm)
    sizes = ModelSizes(hidden_size=32, enc_hidden_size=32, enc_num_attention_heads=4, image_size=24 if class_token
                       else 32, patch_size=8, vision_arch=arch)
    init_outside_training(SEED, tp_rank=pgs.tp.rank())
    torch.manual_seed(SEED)
    encoder = build_vision_encoder(sizes, tp, pgs)
    gen = torch.Generator().manual_seed(SEED)
    images = torch.rand(3, 3, sizes.image_size, sizes.image_size, generator=gen).requires_grad_()
    patches, cp, cp_rank = sizes.patches_per_image, pgs.cp.size(), pgs.cp.rank()
    # The rows a CP rank emits: patches [c*n//cp, (c+1)*n//cp) of each image (boundary/plan.py)
    mine = torch.cat([torch.arange(i * patches + cp_rank * patches // cp, i * patches + (cp_rank + 1) * patches // cp)
                      for i in range(3)])
    weights = torch.randn(3 * patches, sizes.hidden_size, generator=gen)[mine]
    rows = encoder(images)
    (rows * weights).sum().backward()
    for tensor in [images.grad, *(p.grad for p in encoder.parameters())]:
        dist.all_reduce(tensor, group=pgs.cp)
    for param in encoder.parameters():
        param.main_grad = param.grad
    grads = full_tensors(encoder, pgs.tp, grads=True)
    return rows.detach(), mine, images.grad, grads, encoder.decoder.layers[0].self_attention.core_attention.cp


def _encoder_cp_pairs(case, ref_pgs):
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.spec.layout import ModuleLayout

    tp, cp, dp, class_token, pre_norm = ENCODER_CASES[case]
    pgs = build_module_groups(ModuleLayout(case, "encoder", tp=tp, cp=cp, dp=dp)).pgs
    rows, mine, image_grad, grads, attention_cp = _run_encoder(pgs, tp, class_token, pre_norm)
    ref_rows, _, ref_image_grad, ref_grads, _ = _run_encoder(ref_pgs, 1, class_token, pre_norm)
    assert attention_cp == cp  # real CP attention, not replicas
    pairs = {"rows": (rows, ref_rows[mine]), "image grad": (image_grad, ref_image_grad)}
    pairs.update({f"grad {name}": (grads[name], want) for name, want in ref_grads.items()})
    return pairs


def _module_pairs(ours, theirs, *inputs, **kwargs):
    """Outputs, input gradients and parameter gradients of two modules with the same weights."""
    theirs.load_state_dict(ours.state_dict())  # strict: the parameter names match too
    pairs = {}
    for key, module in (("got", ours), ("want", theirs)):
        leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = module(*leaves, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        tensors = {"output": out.detach()}
        tensors.update({f"input grad {i}": x.grad for i, x in enumerate(leaves) if x.requires_grad})
        tensors.update({f"grad {n}": p.grad for n, p in module.named_parameters()})
        for name, tensor in tensors.items():
            pairs.setdefault(name, [None, None])[key == "want"] = tensor
    return pairs


def _megatron_local_pairs(ref_pgs):
    """Our spec vs megatron-core's local spec (DotProductAttention, torch norms), one process."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_hetero.models.attention import SDPAttention
    from megatron_hetero.models.mlp import mlp_summary
    from megatron_hetero.models.quack_kernels import TORCH, QuackChoice
    from megatron_hetero.models.specs import block_spec, encoder_layer_spec, llm_layer_spec
    from megatron_hetero.models.vlm import causal_mask, transformer_config
    from megatron_hetero.parallel.parallel_state import init_outside_training

    init_outside_training(SEED, tp_rank=0)
    torch.manual_seed(SEED)
    results = {}

    config = transformer_config(32, 2, 4, 1, torch.float32)
    x = torch.randn(SEQ, BATCH, 32)
    blocks = [
        TransformerBlock(config, spec, pre_process=True, post_process=True, pg_collection=ref_pgs)
        for spec in (block_spec(encoder_layer_spec(ref_pgs), config, ref_pgs), get_vit_layer_with_local_spec())
    ]
    results["encoder_block"] = _module_pairs(*blocks, x, attention_mask=None)
    # With biases under --bias-dropout-fusion: our MLP's bias add and GELU as one compiled kernel.
    fused = transformer_config(32, 2, 4, 1, torch.float32, add_bias_linear=True, bias_dropout_fusion=True)
    blocks = [
        TransformerBlock(fused, spec, pre_process=True, post_process=True, pg_collection=ref_pgs)
        for spec in (block_spec(encoder_layer_spec(ref_pgs), fused, ref_pgs), get_vit_layer_with_local_spec())
    ]
    for layer in blocks[0].layers:  # megatron-core's forward with the fused bias-GELU, not the quack stand-in
        assert layer.mlp.fused_bias_activation
        layer.mlp.epilogue = QuackChoice(TORCH, "the path under test")
    assert mlp_summary(blocks[0]) == "torch (the path under test); torch's path: fc1 bias and activation compiled"
    with torch.no_grad():  # megatron initializes biases to zero
        for name, param in blocks[0].named_parameters():
            if name.endswith("bias"):
                param.normal_()
    results["encoder_block_fused_bias_gelu"] = _module_pairs(*blocks, x, attention_mask=None)
    blocks = [
        TransformerBlock(config, spec, pre_process=True, post_process=True, pg_collection=ref_pgs)
        for spec in (block_spec(llm_layer_spec(ref_pgs), config, ref_pgs), get_gpt_layer_local_spec())
    ]
    results["llm_block"] = _module_pairs(*blocks, x, attention_mask=causal_mask(SEQ, "cpu"))

    # Core attention alone: GQA (4 heads, 2 groups), and an explicit padding mask honoured.
    gqa = transformer_config(32, 1, 4, 1, torch.float32, num_query_groups=2)
    q, kv = torch.randn(SEQ, BATCH, 4, 8), torch.randn(SEQ, BATCH, 2, 8)
    padding = torch.rand(BATCH, 1, SEQ, SEQ) < 0.3
    padding[..., 0] = False  # every query keeps a key
    for name, mask_type, mask in (
        ("gqa_causal", AttnMaskType.causal, causal_mask(SEQ, "cpu")),
        ("gqa_padding", AttnMaskType.padding, padding),
    ):
        core = [cls(gqa, 1, mask_type, "self", pg_collection=ref_pgs) for cls in (SDPAttention, DotProductAttention)]
        results[name] = _module_pairs(*core, q, kv, kv, mask)
    return results


def _worker(rank, world_size):
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.patches import cpu
    from megatron_hetero.spec.layout import ModuleLayout
    from tests.quack_stand_in import use_stand_in

    cpu.apply()
    use_stand_in(setattr)
    # Every rank its own 1-process reference (tp = cp = 1).
    ref_pgs = build_module_groups(ModuleLayout("reference", "llm", dp=world_size)).pgs
    results = {case: _parallel_llm_pairs(case, ref_pgs) for case in CASES}
    results.update({case: _encoder_cp_pairs(case, ref_pgs) for case in ENCODER_CASES})
    if rank == 0:
        results.update(_megatron_local_pairs(ref_pgs))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return collect_distributed(_worker, 4, tmp_path_factory.mktemp("layers"))


def _assert_pairs(pairs, rtol, grad_rtol):
    """Tolerances relative to each tensor's scale: a constant factor (e.g. TP replicas summed) fails."""
    assert pairs
    for name, (got, want) in pairs.items():
        tol = grad_rtol if "grad" in name else rtol
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=name)


@pytest.mark.parametrize("case", CASES)
def test_parallel_llm_reproduces_one_process(runs, case):
    """Per-token losses at the rank's positions, gradients of its boundary slots, and every
    parameter's whole gradient (TP-gathered, summed over CP) match the 1-process model."""
    for rank_results in runs:
        _assert_pairs(rank_results[case], rtol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_encoder_cp_reproduces_one_process(runs, case):
    """An encoder under CP (TP, DP and a class token beside it): each rank's rows are its part of
    every image's, its core attention over the CP group; the images' and every parameter's
    gradients (summed over CP) match the 1-process encoder."""
    for rank_results in runs:
        _assert_pairs(rank_results[case], rtol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("case", ["encoder_block", "encoder_block_fused_bias_gelu", "llm_block", "gqa_causal",
                                  "gqa_padding"])
def test_matches_megatron_local_layers(runs, case):
    """Same weights, same inputs: outputs within 1e-6; gradients within 1e-5 (SDPA's kernels
    round differently from megatron's baddbmm + softmax)."""
    _assert_pairs(runs[0][case], rtol=1e-6, grad_rtol=1e-5)
