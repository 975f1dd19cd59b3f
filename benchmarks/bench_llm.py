"""The LLM alone: forward + backward TFLOPS/GPU of a GPTModel stack on our layer spec or on
megatron-core's local spec, same shapes, one line of JSON per run.

    torchrun --nproc-per-node 2 benchmarks/bench_llm.py --tp 2 --layers 8 --seq 16384 --micro 2 \\
        --spec ours --params bf16 [--attention cudnn] [--profile FILE] --out llm.jsonl

--spec local: megatron-core's get_gpt_layer_local_spec (its DotProductAttention materializes the
s x s scores: short sequences only; no CP). --params bf16: bf16 weights (Megatron's --bf16);
--params autocast: fp32 weights under bf16 autocast. --attention picks torch's SDPA kernel
(auto: torch's own order). FLOPs are the planner's (megatron_hetero.planner), x3 for forward and
backward; no optimizer step, no DP.
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def build(opts, pgs, dtype):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hetero.models.vlm import build_llm
    from megatron_hetero.spec.sizes import ModelSizes

    sizes = ModelSizes(hidden_size=opts.hidden, num_layers=opts.layers, num_attention_heads=opts.heads,
                       seq_length=opts.seq)
    spec = get_gpt_layer_local_spec() if opts.spec == "local" else None
    # Weights initialized on the GPU: the numbers do not matter here, the time does. The cast is
    # Megatron's Float16Module's (the local spec's torch norms are built in fp32).
    llm = build_llm(sizes, opts.tp, pgs, dtype, whole=True, sp=opts.sp, transformer_layer_spec=spec,
                    use_cpu_initialization=False)
    return llm.to(device=torch.cuda.current_device(), dtype=dtype)


def llm_flops(opts) -> float:
    """Model FLOPs of one forward + backward of a micro batch."""
    from megatron_hetero.planner import ModuleShape, module_forward_flops_per_sample

    shape = ModuleShape("llm", "llm", opts.hidden, opts.layers, opts.heads, 4 * opts.hidden,
                        seq_length=opts.seq, vocab=128)
    return 3 * opts.micro * module_forward_flops_per_sample(shape, opts.hidden)


def run(opts) -> dict:
    import torch.distributed as dist

    from megatron_hetero.models.context_parallel import cp_positions
    from megatron_hetero.models.vlm import llm_forward
    from megatron_hetero.parallel.groups import build_module_groups, init_distributed
    from megatron_hetero.parallel.parallel_state import init_outside_training
    from megatron_hetero.spec.layout import ModuleLayout

    device = init_distributed()
    pgs = build_module_groups(ModuleLayout("llm", "llm", tp=opts.tp, cp=opts.cp, sp=opts.sp)).pgs
    init_outside_training(1234, tp_rank=pgs.tp.rank())
    dtype = torch.bfloat16 if opts.params == "bf16" else torch.float32
    llm = build(opts, pgs, dtype)
    s_local = opts.seq // opts.cp
    positions = cp_positions(opts.seq, opts.cp, pgs.cp.rank(), device).expand(opts.micro, s_local)
    ids = torch.randint(0, 128, (opts.micro, s_local), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=opts.params == "autocast")
    kernel = contextlib.nullcontext()
    if opts.attention != "auto":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[opts.attention])])

    def step():
        with autocast, kernel:
            loss = llm_forward(llm, ids, positions, [], labels=ids).float().sum()
        loss.backward()

    for _ in range(opts.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(opts.steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / opts.steps
    if opts.profile:  # every rank steps (TP collectives), rank 0 writes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if dist.get_rank() == 0:
            Path(opts.profile).write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    record = dict(spec=opts.spec, params=opts.params, attention=opts.attention, tp=opts.tp, cp=opts.cp,
                  sp=opts.sp, layers=opts.layers, hidden=opts.hidden, seq=opts.seq, micro=opts.micro,
                  step_ms=1e3 * step_s, tflops_per_gpu=llm_flops(opts) / step_s / (opts.tp * opts.cp) / 1e12,
                  peak_gb=torch.cuda.max_memory_allocated() / 2**30, date=time.strftime("%Y-%m-%d"),
                  device=torch.cuda.get_device_name(), torch=torch.__version__)
    if dist.get_rank() == 0:
        print(json.dumps(record))
        with open(opts.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", choices=["ours", "local"], default="ours")
    parser.add_argument("--params", choices=["bf16", "autocast"], default="bf16")
    parser.add_argument("--attention", choices=["auto", *SDPA_BACKENDS], default="auto")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", help="rank 0's CUDA kernel table of one more step, to this file")
    parser.add_argument("--out", default="bench_llm.jsonl")
    opts = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if opts.tp * opts.cp != world:
        parser.error(f"--tp x --cp must be the world size {world}")
    if not torch.cuda.is_available():
        parser.error("bench_llm measures GPUs; none is visible")
    if opts.spec == "local" and opts.cp > 1:
        parser.error("megatron-core's local attention has no context parallelism; use --spec ours for --cp")
    run(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
