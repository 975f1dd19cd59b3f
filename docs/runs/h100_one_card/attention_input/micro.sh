#!/usr/bin/env bash
# From the repository root on a GPU machine: the attention input alone at Qwen2.5-VL-7B's ViT shape (10528 tokens, 16
# heads x 80, RoPE, bias), ours vs the compiled function, 50 calls each after 5: CUDA-event time and host time a call.
set -uo pipefail
(OUT=/tmp/envcheck; source benchmarks/gpu_env.sh >/dev/null; python3 - <<'PY' 2>&1 | tail -12 | tee $OUT/micro.log
import time, torch
from megatron_hetero.models import attention_input
from megatron_hetero.models.packed_attention import packed_heads
g = torch.Generator(device="cuda").manual_seed(0)
groups, head_dim, tokens = 16, 80, 10528
width = groups * 3 * head_dim
mixed = torch.randn(tokens, 1, width, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
bias = torch.randn(width, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
angles = torch.rand(tokens, 1, 1, head_dim, device="cuda", generator=g) * 6
rotary = (angles.cos().bfloat16(), angles.sin().bfloat16()) * 2
grads = [torch.randn(tokens, h, head_dim, device="cuda", generator=g, dtype=torch.bfloat16) for h in (16, 16, 16)]
compiled = torch.compile(packed_heads, fullgraph=True)
for run_dim in (80, 96):
    grads = [torch.randn(tokens, 16, run_dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    for name, fn in (("compiled", compiled), ("ours", attention_input.packed_heads)):
        for backward in (False, True):
            def step():
                out = fn(mixed, bias, rotary, groups, 1, head_dim, run_dim)
                if backward:
                    torch.autograd.backward(out, grads)
            for _ in range(5): step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); start.record()
            for _ in range(50): step()
            end.record(); host = (time.perf_counter() - t0) / 50 * 1e3; torch.cuda.synchronize()
            print(f"run dim {run_dim} {name:8s} {'fwd+bwd' if backward else 'fwd    '}: GPU {start.elapsed_time(end) / 50:.3f} ms a call, host {host:.3f} ms a call (launch, not waiting)")
PY
)
