"""An MoE layer's experts on grouped GEMMs (models/experts.py) without a GPU.

- the grouped forward equals megatron-core's SequentialMLP with the same parameters: the output and
  every gradient (tokens, routing probabilities, each expert's weights), experts receiving no token
  included, in float64 (the per-expert loop of the same Function) and float32 (torch's CPU grouped
  GEMM), with and without the fused weighted SwiGLU; weight gradients into main_grad under
  gradient-accumulation fusion;
- which experts run grouped (pure: mode, device, dtype, widths, configurations it does not compute)
  and the kernel policy's override; the LLM's local layer spec builds them;
- which all-to-all dispatchers keep their token counts on the device (patches/moe_dispatch.py), and
  its identity sort.
The layouts with expert and expert-tensor parallelism train through them in test_moe.py (CPUs run
SequentialMLP's forward under auto); `megatron-hetero kernels check experts` checks the kernels on a GPU.
"""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.attention_kernels import Device
from megatron_hetero.models.experts import (
    GROUPED,
    SEQUENTIAL,
    ExpertsChoice,
    GroupedExperts,
    aligned,
    choose_experts,
    experts_mode,
    experts_summary,
    stacked,
)
from megatron_hetero.models.kernel_policy import EXPERTS_KERNEL_ENV, KernelModeError, build
from megatron_hetero.patches import moe_dispatch
from megatron_hetero.patches.moe_dispatch import needs_host_counts
from tests.test_mlp_kernels import _accumulating

HIDDEN, FFN = 16, 8
COUNTS = [3, 0, 5, 2, 0, 6]  # tokens per local expert, two receiving none
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0))


pytestmark = pytest.mark.usefixtures("one_rank")  # megatron's linears ask a TP group's size


def _config(dtype=torch.float64, **fields) -> TransformerConfig:
    fields = {"gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": False,
              "bias_activation_fusion": False, **fields}
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=len(COUNTS),
                             moe_ffn_hidden_size=FFN, moe_router_topk=2, params_dtype=dtype,
                             use_cpu_initialization=True, **fields)


def _experts(cls, config):
    one = dist.group.WORLD
    torch.manual_seed(0)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return cls(len(COUNTS), config, submodules, pg_collection=ProcessGroupCollection(ep=one, expt_tp=one,
                                                                                     expt_dp=one))


def _run(experts, dtype, counts=COUNTS):
    """Output and gradients (tokens, probabilities, every weight by name) of one forward and backward."""
    generator = torch.Generator().manual_seed(1)
    tokens = sum(counts)
    x = torch.randn(tokens, HIDDEN, generator=generator, dtype=dtype).requires_grad_()
    probs = torch.rand(tokens, generator=generator, dtype=dtype).requires_grad_()
    out, bias = experts(x, torch.tensor(counts), probs)
    assert bias is None
    out.backward(torch.randn(out.shape, generator=generator, dtype=dtype))
    grads = {name: p.grad if p.grad is not None else p.main_grad for name, p in experts.named_parameters()}
    return out.detach(), x.grad, probs.grad, grads


def _assert_same(got, want, tolerance):
    for name, a, b in zip(("output", "token gradients", "probability gradients"), got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=name)
    assert got[3].keys() == want[3].keys() and len(got[3]) == 2 * len(COUNTS)
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 0.0), (torch.float32, 1e-5)], ids=["loop", "grouped"])
@pytest.mark.parametrize("fused_swiglu", [False, True], ids=["swiglu", "fused_swiglu"])
def test_grouped_equals_sequential(monkeypatch, dtype, tolerance, fused_swiglu):
    """float64: the per-expert loop of the grouped Function, bit for bit; float32: torch's grouped GEMM
    on the CPU, within float32 rounding. Experts 1 and 4 get no tokens: zero weight gradients."""
    monkeypatch.setenv(EXPERTS_KERNEL_ENV, GROUPED)
    config = _config(dtype, bias_activation_fusion=fused_swiglu)
    grouped = _experts(GroupedExperts, config)
    assert grouped.choice == ExpertsChoice(GROUPED) and experts_summary(grouped) == GROUPED
    got, want = _run(grouped, dtype), _run(_experts(SequentialMLP, config), dtype)
    _assert_same(got, want, tolerance)
    assert not got[3]["local_experts.1.linear_fc1.weight"].any()


def test_packed_weights_are_read_without_a_copy(monkeypatch):
    """The grouped experts' weights are views of one tensor per linear, again after a cast; where they
    are apart (as megatron's distributed optimizer places them) the stacked copy gives the same
    numbers."""
    monkeypatch.setenv(EXPERTS_KERNEL_ENV, GROUPED)
    grouped = _experts(GroupedExperts, _config(torch.float32)).double()
    for name in ("linear_fc1", "linear_fc2"):
        weights = [getattr(expert, name).weight for expert in grouped.local_experts]
        assert weights[0].dtype == torch.float64 and stacked(weights).data_ptr() == weights[0].data_ptr()
    want = _run(_experts(SequentialMLP, _config(torch.float64)), torch.float64)
    _assert_same(_run(grouped, torch.float64), want, 0.0)
    for expert in grouped.local_experts:  # apart: each in its own tensor
        expert.linear_fc1.weight.data = expert.linear_fc1.weight.data.clone()
        expert.linear_fc1.weight.grad = expert.linear_fc2.weight.grad = None
    weights = [expert.linear_fc1.weight for expert in grouped.local_experts]
    assert stacked(weights).data_ptr() != weights[0].data_ptr()
    _assert_same(_run(grouped, torch.float64), want, 0.0)


def test_no_tokens_at_all(monkeypatch):
    """An expert-parallel rank that receives no token: an empty output, zero weight gradients."""
    monkeypatch.setenv(EXPERTS_KERNEL_ENV, GROUPED)
    config = _config(torch.float32)
    got = _run(_experts(GroupedExperts, config), torch.float32, counts=[0] * len(COUNTS))
    assert got[0].shape == (0, HIDDEN) and not any(grad.any() for grad in got[3].values())


def test_weight_gradients_accumulate_into_main_grad(monkeypatch):
    """Under gradient-accumulation fusion each expert's weight gradient is added to its main_grad
    (two microbatches) and DDP's placeholder returned, as megatron's linear layers do."""
    _accumulating(monkeypatch)
    monkeypatch.setattr(tp_layers, "_grad_accum_fusion_available", True)  # the plugin's, as on GPUs
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where megatron's placeholders go
    monkeypatch.setenv(EXPERTS_KERNEL_ENV, GROUPED)
    config = _config(torch.float32, gradient_accumulation_fusion=True)  # megatron's linears: fp32 main_grad
    results = []
    for cls in (GroupedExperts, SequentialMLP):
        experts = _experts(cls, config)
        for weight in experts.parameters():
            weight.main_grad = torch.full_like(weight, 0.5)
            weight.grad_added_to_main_grad = False
            weight.zero_out_wgrad = True
        results.append([_run(experts, torch.float32) for _ in range(2)][-1])
        assert all(w.grad_added_to_main_grad and not w.grad.any() for w in experts.parameters())
    _assert_same(*results, tolerance=1e-5)


def test_which_experts_run_grouped(monkeypatch):
    """auto: grouped on sm90 GPUs in bf16 with aligned widths, else sequential, each with its reason;
    grouped and sequential pin it (but not for configurations the grouped forward does not compute)."""
    bf16, widths = _config(torch.bfloat16), (HIDDEN, 2 * FFN, FFN)
    assert choose_experts("auto", bf16, 6, widths, H100) == ExpertsChoice(GROUPED)
    cases = {("auto", Device("cpu")): "no GPU", ("auto", Device("A100", (8, 0))): "checked on sm90",
             ("auto", Device("B200", (10, 0))): "checked on sm90",
             ("sequential", H100): f"{EXPERTS_KERNEL_ENV}=sequential"}
    for (mode, device), reason in cases.items():
        choice = choose_experts(mode, bf16, 6, widths, device)
        assert choice.kernel == SEQUENTIAL and reason in choice.reason
    assert "torch.float32 weights" in choose_experts("auto", _config(torch.float32), 6, widths, H100).reason
    assert "not multiples of 8" in choose_experts("auto", bf16, 6, (HIDDEN, 12, 6), H100).reason
    assert choose_experts("grouped", _config(torch.float32), 6, (HIDDEN, 12, 6), Device("cpu")).kernel == GROUPED
    unsupported = {"one local expert": (bf16, 1), "SwiGLU": (_config(torch.bfloat16, activation_func=F.gelu), 6),
                   "biases": (_config(torch.bfloat16, add_bias_linear=True), 6)}
    for reason, (config, experts) in unsupported.items():
        choice = choose_experts("grouped", config, experts, widths, H100)
        assert choice.kernel == SEQUENTIAL and reason in choice.reason
    assert build(environ={EXPERTS_KERNEL_ENV: "sequential"}).experts == "sequential"
    assert experts_mode(bf16, {}) == "auto"
    assert experts_mode(bf16, {EXPERTS_KERNEL_ENV: "grouped"}) == "grouped"
    with pytest.raises(KernelModeError, match=f"{EXPERTS_KERNEL_ENV}=torch: use one of auto, grouped, sequential"):
        experts_mode(bf16, {EXPERTS_KERNEL_ENV: "torch"})


def test_alignment_of_the_grouped_operands():
    """The weight-gradient GEMM's transposed operand is aligned by its rows' width, not by the token
    count (an odd count of tokens takes the grouped GEMM); a 12-element width is not."""
    tokens, w = torch.empty(1001, 2048), torch.empty(6, 1536, 2048)
    dy = torch.empty(1001, 1536)
    assert aligned(tokens, w.transpose(1, 2), dy, w, dy.t())
    assert not aligned(torch.empty(1001, 12)) and not aligned(torch.empty(1001, 12).t())


def test_cpu_runs_sequential_under_auto(monkeypatch):
    """auto leaves CPUs to SequentialMLP's forward (the training tests' numbers unchanged)."""
    monkeypatch.delenv(EXPERTS_KERNEL_ENV, raising=False)
    experts = _experts(GroupedExperts, _config(torch.float32))
    assert experts.choice == ExpertsChoice(SEQUENTIAL, "no GPU") and experts_summary(experts) == "sequential (no GPU)"


def test_llm_spec_builds_grouped_experts():
    from megatron_hetero.models.specs import llm_layer_spec

    moe = llm_layer_spec(None, num_experts=4, te=False).submodules.mlp.keywords["submodules"]
    assert moe.experts.func is GroupedExperts
    dense = llm_layer_spec(None, num_experts=None, te=False).submodules.mlp.keywords["submodules"]
    assert not hasattr(dense, "experts")


# ---- the dispatcher's host sync (patches/moe_dispatch.py) ------------------------------------------
def _dispatcher(ep=1, tp=1, capacity=None, padding=False, drop_and_pad=False):
    config = types.SimpleNamespace(moe_expert_capacity_factor=capacity, moe_router_padding_for_quantization=padding)
    return types.SimpleNamespace(config=config, ep_size=ep, tp_size=tp, drop_and_pad=drop_and_pad)


def test_dispatcher_keeps_counts_on_the_device_with_one_rank_dropless():
    """Host counts only where the all-to-all needs split sizes (EP or expert TP) or routing drops or
    pads tokens; the identity sort returns its input, another one sorts as upstream."""
    assert not needs_host_counts(_dispatcher())
    for needing in ({"ep": 2}, {"tp": 2}, {"capacity": 1.0}, {"padding": True}, {"drop_and_pad": True}):
        assert needs_host_counts(_dispatcher(**needing)), needing
    x, probs = torch.arange(6.0).unsqueeze(1), torch.arange(6.0)
    sort = moe_dispatch._identity_sort(sort_chunks_by_idxs)
    out, out_probs = sort(x, torch.tensor([2, 1, 3]), torch.arange(3), probs)
    assert out is x and out_probs is probs
    out, out_probs = sort(x, torch.tensor([2, 1, 3]), torch.tensor([2, 0, 1]), probs)
    assert out.flatten().tolist() == [3, 4, 5, 0, 1, 2] and out_probs.tolist() == [3, 4, 5, 0, 1, 2]


# ---- the GPU check's judging (cli/checks/experts.py, its correctness part on the CPU) ---------------
def test_gpu_check_passes_grouped_experts_and_fails_a_wrong_gradient(monkeypatch):
    """The check's errors against fp32 (bf16 on torch's CPU grouped GEMM here) pass the grouped
    experts and fail them with fc2's weight gradients of the wrong expert."""
    from megatron_hetero.cli.checks import experts as check
    from megatron_hetero.models import experts

    def accumulate(total_input, grad_output, main_grad):  # megatron's fusion in fp32, as on GPUs
        main_grad.add_(grad_output.t().float() @ total_input.float())

    monkeypatch.setattr(check, "DEVICE", "cpu")
    monkeypatch.setattr(tp_layers, "fused_weight_gradient_mlp_cuda",
                        types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate), raising=False)
    monkeypatch.setattr(tp_layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setenv(EXPERTS_KERNEL_ENV, GROUPED)
    case = check.Case("tiny", 64, len(COUNTS), FFN, hidden=HIDDEN, topk=2)
    assert check.measure(case, iters=0)["ok"]
    grouped_mm = experts.grouped_mm

    def rolled(a, b, ends):  # each expert's weight gradient given to the next expert
        out = grouped_mm(a, b, ends)
        return out.roll(1, 0) if b.dim() == 2 and a.shape[0] == HIDDEN else out
    monkeypatch.setattr(experts, "grouped_mm", rolled)
    record = check.measure(case, iters=0)
    assert not record["ok"] and record["grouped_dw2_err"] > check.TOLERANCE >= record["sequential_dw2_err"]
