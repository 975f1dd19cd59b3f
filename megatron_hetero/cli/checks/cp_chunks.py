"""A CP query chunk's bottom-right causal attention on one GPU: cuDNN merged (models/chunk_attention.py)
against SDPA's bottom-right mask (what attention.py runs without it) and fp32 attention.

    megatron-hetero kernels check cp-chunks [--quick] [--record]   (one GPU)

1. Exactness, bf16, 4 heads x 128, chunks of 1024-2048 queries behind 1-3 chunks of keys: outputs and
   dq/dk/dv against fp32 attention (max |diff| / max |ref|). PASS where every merged error is at most
   twice SDPA's own (bf16 rounding: 0.01 floor); then it prints the MEGATRON_HETERO_CUDNN_MERGE_CHECKED
   line that lets context-parallel attention run the merged path on this GPU (--record writes this
   GPU into the user's table of models/kernel_policy.py instead).
2. Speed, bf16, 32 heads x 128 (the 7B LLM), the chunks CP2 gives each rank at 16K / 32K / 64K (the
   later chunk of each rank: 1 to 3 chunks of keys before it): forward+backward ms, median of 10,
   merged vs the mask, and the square causal call (cuDNN) of the same queries for scale.
Exit 1 where a merged error fails the bar, 2 without a GPU.
"""

import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron_hetero.models.chunk_attention import CUDNN_KERNEL, prefix_causal_attention
from megatron_hetero.models.kernel_policy import CUDNN_MERGE_ENV, record_check


def reference(q, k, v):
    """fp32 attention, query i seeing keys up to sk - sq + i."""
    sq, sk = q.shape[-2], k.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk))


def merged(q, k, v):
    return prefix_causal_attention(q, k, v, CUDNN_KERNEL)


def masked(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return [t.float() for t in (out, q.grad, k.grad, v.grad)]


def errors(fn, inputs, dout, expected) -> list[float]:
    got = grads(fn, *inputs, dout)
    return [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected)]


def check(chunk: int, before: int, heads: int = 4) -> bool:
    """One shape: merged and masked errors; True where merged passes the bar."""
    g = torch.Generator("cuda").manual_seed(chunk + before)
    q, k, v = (torch.randn(1, heads, n, 128, device="cuda", generator=g)
               for n in (chunk, chunk * (before + 1), chunk * (before + 1)))
    dout = torch.randn(1, heads, chunk, 128, device="cuda", generator=g)
    expected = grads(reference, q, k, v, dout)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    ours, sdpa = errors(merged, bf16, dout, expected), errors(masked, bf16, dout, expected)
    ok = all(a <= max(2 * b, 0.01) for a, b in zip(ours, sdpa))
    cells = " ".join(f"{n} {a:.4f}/{b:.4f}" for n, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa))
    print(f"chunk {chunk:>5} after {before} chunks: merged/sdpa-mask {cells}  {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def time_ms(fn, q, k, v, dout, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        q.grad = k.grad = v.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(q, k, v).backward(dout)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def speed(seq: int, iters: int) -> None:
    chunk = seq // 4
    for before in (1, 2, 3):
        q, k, v = (torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for n in (chunk, chunk * (before + 1), chunk * (before + 1)))
        dout = torch.randn_like(q)
        ours, sdpa = time_ms(merged, q, k, v, dout, iters), time_ms(masked, q, k, v, dout, iters)
        square = time_ms(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                         q, k[:, :, -chunk:], v[:, :, -chunk:], dout, iters)
        print(f"seq {seq:>6} chunk {chunk:>5} after {before}: merged {ours:8.2f} ms, sdpa mask {sdpa:8.2f} ms "
              f"({sdpa / ours:.2f}x), square causal alone {square:7.2f} ms", flush=True)


def main(quick: bool, record: bool) -> int:
    if not torch.cuda.is_available():
        print("error: no GPU visible: this checks the cuDNN path")
        return 2
    name = torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    ok = all([check(chunk, before) for chunk in (1024, 2048) for before in (1, 2, 3)])
    for seq in (16384, 32768) if quick else (16384, 32768, 65536):
        speed(seq, 5 if quick else 10)
    if not ok:
        print(f"FAIL: leave {name} out of the merged-chunk GPUs (context-parallel attention keeps SDPA's mask)")
        return 1
    if record:
        print(f"PASS: recorded {name} in {record_check(name, cudnn_merge=True)}: the kernel policy reads it")
    else:
        print(f"PASS: to run the merged path on {name}: export {CUDNN_MERGE_ENV}=1 (or run again with --record)")
    return 0
