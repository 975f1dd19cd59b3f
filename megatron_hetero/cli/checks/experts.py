"""Are an MoE layer's grouped expert GEMMs (models/experts.py) right on this GPU at Qwen3-VL-30B-A3B's
shape, faster than megatron-core's SequentialMLP, and is the MoE layer's forward and backward free
of host syncs?

    megatron-hetero kernels check experts [--quick] [--out DIR]   (one GPU)

Per case (tokens routed top-8 to 128 experts of hidden 2048 and ffn 768, two experts receiving no token; an EP2
rank's 64 experts; expert TP2's halves): the output, the token and probability gradients and every expert's
weight gradient (accumulated into fp32 main_grad, as megatron's gradient-accumulation fusion does in training)
of SequentialMLP and of GroupedExperts in bf16 against SequentialMLP in fp32 on the same weights, as max |diff|
/ max |ref|; both paths' forward and forward+backward ms (CUDA events, calls back to back) and the GPU's work
alone (common.gpu_ms). Then the whole MoE layer (router, all-to-all dispatcher, experts) forward and backward
under torch.cuda.set_sync_debug_mode: the synchronizing calls counted, with each experts kind, with and without
patches/moe_dispatch.py. A grouped error above TOLERANCE, or in the grouped layer with the patch a sync or no
fewer waits than without it: FAIL, exit 1. Records (one JSON object per line) go to DIR/experts_check.jsonl; DIR
defaults to $OUT or out/.
"""

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_hetero.cli.checks.common import measure_paths
from megatron_hetero.models.kernel_policy import EXPERTS_KERNEL_ENV

TOLERANCE = 0.02  # SequentialMLP's own bf16 error against fp32 is ~0.005-0.01
GRADS = ("out", "dx", "dprobs", "dw1", "dw2")
DEVICE = "cuda"  # the CPU runs its correctness part for a smoke check of the tool


class Case(NamedTuple):
    name: str
    tokens: int
    experts: int  # local experts
    ffn: int  # per expert-TP rank
    hidden: int = 2048
    topk: int = 8


def cases(quick: bool) -> list[Case]:
    cut = 8 if quick else 1
    return [Case("Qwen3-VL-30B-A3B, 128 experts", 16384 // cut, 128, 768),
            Case("EP2 rank, 64 experts", 16384 // cut, 64, 768),
            Case("expert TP2 rank, 128 experts", 16384 // cut, 128, 384)]


def _config(case: Case, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=case.hidden, num_attention_heads=16,
                             num_moe_experts=case.experts,
                             moe_ffn_hidden_size=case.ffn, moe_router_topk=case.topk, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=True,
                             params_dtype=dtype, bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=True,
                             moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01,
                             use_cpu_initialization=True)  # no model-parallel RNG tracker here


def _pgs():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(**{name: dist.group.WORLD for name in (
        "tp", "pp", "cp", "dp", "dp_cp", "ep", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp")})


def _experts(cls, case: Case, dtype):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    torch.manual_seed(0)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    experts = cls(case.experts, _config(case, dtype), submodules, pg_collection=_pgs()).to(DEVICE)
    for weight in experts.parameters():
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
    return experts


def inputs(case: Case, seed: int = 0):
    """Permuted tokens, the counts per expert (top-k of random logits; experts 0 and 5 get none),
    their probabilities and the output's gradient."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(case.tokens, case.experts, device=DEVICE, generator=g)
    logits[:, [0, 5]] = -float("inf")
    counts = torch.bincount(logits.topk(case.topk).indices.flatten(), minlength=case.experts)
    rows = case.tokens * case.topk
    return (torch.randn(rows, case.hidden, device=DEVICE, generator=g), counts,
            torch.rand(rows, device=DEVICE, generator=g), torch.randn(rows, case.hidden, device=DEVICE, generator=g))


def _grads(experts, case: Case, dtype) -> list[torch.Tensor]:
    x, counts, probs, dout = inputs(case)
    x, probs = x.to(dtype).requires_grad_(), probs.to(dtype).requires_grad_()
    out, _ = experts(x, counts, probs)
    out.backward(dout.to(dtype))
    fc = [[getattr(e, name).weight.main_grad for e in experts.local_experts] for name in ("linear_fc1", "linear_fc2")]
    return [t.float() for t in (out.detach(), x.grad, probs.grad, torch.stack(fc[0]), torch.stack(fc[1]))]


def errors(cls, case: Case) -> dict[str, float]:
    from megatron.core.transformer.moe.experts import SequentialMLP

    reference = _grads(_experts(SequentialMLP, case, torch.float32), case, torch.float32)
    got = _grads(_experts(cls, case, torch.bfloat16), case, torch.bfloat16)
    return {name: float((a - r).abs().max() / r.abs().max()) for name, a, r in zip(GRADS, got, reference)}


def calls(cls, case: Case) -> tuple[Callable, Callable]:
    """A forward call and a forward and backward call of experts of `cls` at bf16, to be timed."""
    experts = _experts(cls, case, torch.bfloat16)
    x, counts, probs, dout = (t.bfloat16() if t.is_floating_point() else t for t in inputs(case))
    x.requires_grad_(), probs.requires_grad_()
    return lambda: experts(x, counts, probs), lambda: experts(x, counts, probs)[0].backward(dout)


def host_syncs(kind: str, case: Case) -> tuple[int, int]:
    """Synchronizing calls in one forward and backward of a whole MoE layer whose experts run `kind`
    (after a warm-up step): those torch's sync debug mode reports, and the CUDA runtime's
    *Synchronize calls in a profile of the same step (event waits included)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hetero.models.experts import GroupedExperts

    os.environ[EXPERTS_KERNEL_ENV] = kind  # the kernel policy of the layers built next
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    config = _config(case._replace(experts=128, ffn=768), torch.bfloat16)
    submodules = MoESubmodules(experts=functools.partial(GroupedExperts, submodules=mlp), router=TopKRouter)
    layer = MoELayer(config, submodules, layer_number=1, pg_collection=_pgs()).to(DEVICE).bfloat16()
    for weight in layer.parameters():
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
    x = torch.randn(case.tokens, 1, config.hidden_size, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    layer(x)[0].sum().backward()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with warnings.catch_warnings(record=True) as caught, torch.profiler.profile(activities=activities) as profile:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        layer(x)[0].sum().backward()
        torch.cuda.set_sync_debug_mode("default")
    waits = sum(event.count for event in profile.key_averages() if "Synchronize" in event.key)
    return sum("synchroniz" in str(w.message) for w in caught), waits


def measure(case: Case, iters: int) -> dict:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hetero.models.experts import GroupedExperts

    os.environ[EXPERTS_KERNEL_ENV] = "grouped"
    record = dict(case=case.name, tokens=case.tokens, experts=case.experts, ffn=case.ffn, topk=case.topk)
    return measure_paths(record, case, {"sequential": SequentialMLP, "grouped": GroupedExperts}, errors, calls,
                         iters, "grouped", TOLERANCE)


def sync_record(case: Case) -> dict:
    """Host syncs of the MoE layer per experts kind, without and with patches/moe_dispatch.py."""
    from megatron_hetero.patches import _patch, moe_dispatch

    record = {"case": f"MoE layer host syncs, {case.tokens} tokens"}
    for patched in (False, True):
        if patched:
            moe_dispatch.apply()
        for kind in ("sequential", "grouped"):
            name = f"{kind}{'_patched' if patched else ''}"
            record[f"{name}_syncs"], record[f"{name}_waits"] = host_syncs(kind, case)
    _patch.undo()
    # The profiler may add waits of its own: the patch must take upstream's away.
    record["ok"] = record["grouped_patched_syncs"] == 0 and record["grouped_patched_waits"] < record["grouped_waits"]
    return record


def main(quick: bool, out: str) -> int:
    from megatron_hetero.patches import grad_accum_fusion

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)  # groups of this process alone
    grad_accum_fusion.apply()  # main_grad accumulation without apex, as in training
    previous = os.environ.get(EXPERTS_KERNEL_ENV)  # the cases set it; the caller's is restored
    try:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        records = [measure(case, 5 if quick else 20) for case in cases(quick)]
        records.append(sync_record(cases(quick)[0]))
    finally:
        dist.destroy_process_group()
        os.environ.pop(EXPERTS_KERNEL_ENV, None)
        if previous is not None:
            os.environ[EXPERTS_KERNEL_ENV] = previous
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "experts_check.jsonl", "a") as f:
        for r in records:
            print(json.dumps(r), flush=True)
            f.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), torch=torch.__version__)) + "\n")
    if all(r["ok"] for r in records):
        print(f"PASS: the grouped experts are right here (the default, auto, runs them on sm90 GPUs; elsewhere "
              f"export {EXPERTS_KERNEL_ENV}=grouped)")
        return 0
    print(f"FAIL: grouped errors above {TOLERANCE} of fp32, or host syncs in the grouped MoE layer; keep "
          f"megatron-core's SequentialMLP: export {EXPERTS_KERNEL_ENV}=sequential")
    return 1
