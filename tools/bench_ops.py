"""The kernels behind the one-GPU step's non-matmul time, on a workload's own shapes:

    python tools/bench_ops.py [--workload W1] [--llm-layers 8] [--ops attention wgrad gemm adam] [--json out.jsonl]

- attention: torch SDPA per backend (cuDNN, flash, memory-efficient), forward and forward+backward,
  for the LLM's causal attention and the vision encoder's, with q, k, v laid out as megatron-core's
  attention hands them to ours (q and k out of RoPE, v a view of the fused QKV output, all
  [s, b, h, d] permuted to [b, h, s, d]); TFLOPS counted as bench_e2e counts them (causal: half).
- wgrad: each LLM linear's weight gradient accumulated into an fp32 main grad: a bf16 GEMM then an
  fp32 add (megatron-core without gradient-accumulation fusion) vs one GEMM accumulating into it
  (patches/grad_accum_fusion.py), and the largest difference between the two.
- gemm: each linear's forward, input-gradient and weight-gradient GEMM in bf16 (LLM and vision, the
  step's costliest matmuls by the profile) under torch's default cuBLAS call and with cuBLASLt
  preferred, each result's largest difference from the default's; with `--iters 300` each GEMM is held
  long enough for the clock to settle where the card's power limit holds it.
- adam: one AdamW step over the workload's parameters as the trainer builds them (the LLM
  --llm-layers deep) as fp32 main params: torch's foreach implementation (megatron-core's choice
  without apex or Transformer Engine) vs its fused one.
"""

import argparse
import json
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_hetero.cli.checks.common import timed
from megatron_hetero.patches.grad_accum_fusion import accumulate_wgrad
from megatron_hetero.planner.presets import (
    BENCH_WORKLOADS,
    trainer_parameter_shapes,
    trainer_vocab_size,
    trainer_workload,
)

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention_inputs(b, s, h, d, device):
    qkv = torch.randn(s, b, h, 3 * d, device=device, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.split(d, dim=-1)
    q, k = q.contiguous(), k.contiguous()  # RoPE's outputs
    return qkv, [t.permute(1, 2, 0, 3) for t in (q, k, v)]


def bench_attention(name, b, s, h, d, causal, iters, device):
    qkv, (q, k, v) = attention_inputs(b, s, h, d, device)
    grad = torch.randn(s, b, h * d, device=device, dtype=torch.bfloat16)
    keys = s / 2 if causal else s
    fwd_flops = 4 * b * s * keys * h * d
    for backend, choice in BACKENDS.items():
        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).permute(2, 0, 1, 3).flatten(2)

        def step():
            forward().backward(grad)
            qkv.grad = None
        try:
            with sdpa_kernel(choice):
                with torch.no_grad():
                    fwd = timed(forward, iters)
                both = timed(step, iters)
        except RuntimeError as error:
            yield {"op": "attention", "shape": name, "backend": backend, "error": str(error).splitlines()[0][:120]}
            continue
        yield {"op": "attention", "shape": name, "backend": backend, "b": b, "s": s, "heads": h, "head_dim": d,
               "causal": causal, "fwd_ms": fwd, "bwd_ms": both - fwd, "fwd_tflops": fwd_flops / fwd / 1e9,
               "bwd_tflops": 2.5 * fwd_flops / (both - fwd) / 1e9}


def bench_wgrad(tokens, shapes, iters, device):
    for name, (n_in, n_out) in shapes.items():
        x = torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16)
        g = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
        main = torch.zeros(n_out, n_in, device=device, dtype=torch.float32)
        unfused = timed(lambda: main.add_(g.t() @ x), iters)
        fused = timed(lambda: accumulate_wgrad(x, g, main), iters)
        reference, result = torch.zeros_like(main), torch.zeros_like(main)
        reference.add_(g.t() @ x)
        accumulate_wgrad(x, g, result)
        yield {"op": "wgrad", "linear": name, "tokens": tokens, "in": n_in, "out": n_out, "unfused_ms": unfused,
               "fused_ms": fused, "max_abs_diff": (result - reference).abs().max().item(),
               "max_abs": reference.abs().max().item()}


def bench_gemm(linears, iters, device):
    """Each linear's three GEMMs as megatron-core's layers call them (weights [out, in]; the forward
    `x @ w.t()`, the input gradient `g @ w`, the weight gradient `g.t() @ x`), on cuBLAS and cuBLASLt."""
    for name, (tokens, n_in, n_out) in linears.items():
        x = torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16)
        w = torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) * n_in**-0.5
        g = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
        calls = {"fwd": (lambda: x @ w.t(), (tokens, n_in, n_out)), "dgrad": (lambda: g @ w, (tokens, n_out, n_in)),
                 "wgrad": (lambda: g.t() @ x, (n_out, tokens, n_in))}  # (call, (rows, reduced, columns))
        for op, (call, (rows, reduced, cols)) in calls.items():
            reference = call()
            before = torch.backends.cuda.preferred_blas_library()
            for variant in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(variant)
                try:
                    ms = timed(call, iters)
                    diff = (call().float() - reference.float()).abs().max().item()
                finally:
                    torch.backends.cuda.preferred_blas_library(before)
                yield {"op": "gemm", "linear": name, "gemm": op, "variant": variant, "m": rows, "k": reduced,
                       "n": cols, "ms": ms, "tflops": 2 * rows * reduced * cols / ms / 1e9, "max_abs_diff": diff}


def bench_adam(shapes, iters, device):
    grads = [torch.randn(shape, device=device, dtype=torch.float32) * 1e-3 for shape in shapes]
    count, after_one_step = sum(g.numel() for g in grads), {}
    for variant in ("foreach", "fused"):
        params = [torch.ones_like(g, requires_grad=True) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **{variant: True})
        opt.step()
        after_one_step[variant] = [p.detach().clone() for p in params]
        yield {"op": "adam", "variant": variant, "params": count, "tensors": len(params),
               "step_ms": timed(opt.step, iters)}
        del opt, params
    diff = max((a - b).abs().max().item() for a, b in zip(*after_one_step.values()))
    yield {"op": "adam", "variant": "fused vs foreach, one step from the same state", "max_abs_diff": diff}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=list(BENCH_WORKLOADS), default="W1")
    parser.add_argument("--llm-layers", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2, help="bench_e2e's default")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ops", nargs="+", choices=("attention", "wgrad", "gemm", "adam"),
                        default=["attention", "wgrad", "gemm", "adam"])
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("bench_ops times GPU kernels; no GPU is visible")
    device, w = torch.device("cuda"), BENCH_WORKLOADS[opts.workload]
    mb, vocab = opts.micro_batch, trainer_vocab_size()
    h, ffn = w.hidden, trainer_workload(w, vocab, frozen_encoder=False).llm.ffn
    tokens, vision_tokens = mb * w.seq_length, mb * w.images_per_sample * w.tokens_per_image
    e = w.enc_hidden
    # Each linear's (in, out) features, as the trainer builds them (trainer_workload's MLPs).
    llm = {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, ffn), "fc2": (ffn, h)}
    vision = {"qkv": (e, 3 * e), "proj": (e, e), "fc1": (e, 4 * e), "fc2": (4 * e, e)}
    sections = {
        "attention": lambda: [
            *bench_attention("llm", mb, w.seq_length, w.heads, h // w.heads, True, opts.iters, device),
            *bench_attention("vision", mb * w.images_per_sample, w.tokens_per_image, w.enc_heads,
                             e // w.enc_heads, False, opts.iters, device)],
        "wgrad": lambda: bench_wgrad(tokens, llm, opts.iters, device),
        "gemm": lambda: bench_gemm({f"{module} {name}": (n, *shape) for module, n, linears in
                                    (("llm", tokens, llm), ("vision", vision_tokens, vision))
                                    for name, shape in linears.items()}, opts.iters, device),
        "adam": lambda: bench_adam(trainer_parameter_shapes(replace(w, layers=opts.llm_layers), vocab), opts.iters,
                                   device),
    }
    records = [record for op in opts.ops for record in sections[op]()]
    extra = {"workload": opts.workload, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(opts.json, "a") if opts.json else open("/dev/null", "w") as out:
        for record in records:
            record = {**record, **extra}
            print(json.dumps(record))
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
