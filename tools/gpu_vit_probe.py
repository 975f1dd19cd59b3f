"""Which kernels should the packed ViT's attention and the work around it run, at Qwen2.5-VL-7B's bench
shape (8 images of 224-1344 px, 26,144 patches, 16 heads x 80, windows of 112 px)? Measured before
building.

    python3 tools/gpu_vit_probe.py [--iters 20] [--out DIR]   (one GPU; flash-attn-4 where importable)
    python3 tools/gpu_vit_probe.py --family qwen3_vl_8b       (its images' attention at head dim 72 only)
    python3 tools/gpu_vit_probe.py --family internvl3_8b      (InternViT's tiles' attention at head dim 64 only)
    python3 tools/gpu_vit_probe.py --windows-only             (Qwen2.5-VL's windows' attention only)

- attention within the windows (28 of the 32 layers) and within the images (the other 4), forward and
  forward+backward, q/k/v [tokens, 16, 80] bf16: our SDPA path (one batched call per segment shape on
  the tokens grouped by shape: a gather each way), torch's own varlen flash-attention (FA2, head dim 80
  as it is, one launch) and cuDNN's varlen entry where this torch has them, flash-attn-4's varlen call
  zero-padded to 96 where it imports, and for the windows our Triton kernel for short segments
  (models/short_attention.py); each output and gradient against fp32 attention;
- the attention input (QKV bias, split, RoPE, padding to the kernel's head dim; compiled): the half by
  half rotation concatenated then padded, the padding written into that concatenation (the layers'
  packed_heads), and the rotation as a roll of the head times a signed sine (no concatenation);
- bias + residual after the attention's and the MLP's output projections: megatron-core's unfused
  bias-dropout-add (two passes) against its fused one (torch.compile);
- the ViT's SwiGLU backward (megatron-core's compiled swiglu_back on [tokens, 2 x 3424]) against the
  same arithmetic writing both halves from one read (a stack instead of a concatenation).
With --family qwen3_vl_8b, Qwen3-VL-8B's whole-image attention (16 heads x 72, no windows) alone, on
each of SDPA's backends by itself too (cuDNN, FlashAttention-2, memory-efficient) and flash-attn-4 at
72 unpadded (its Hopper backward as patches/fa4_backward.py leaves it: tiles rounded to 32) and
padded to 80 and 96: which kernel runs 72 at the fewest milliseconds with right gradients. With --family
internvl3_8b, InternViT's attention over its bench sample's 12 tiles of 1,025 tokens (16 heads x 64, one
dense batch in Megatron's [s, b, h, d] memory): SDPA's backends and flash-attn-4's dense kernel on the
layers' views and on contiguous copies.
One JSON line per row to DIR/vit_probe.jsonl (DIR: $OUT or out/); GPU kernels per call counted by
torch.profiler for the compiled glue.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from transformers.vision_utils import get_vision_cu_seqlens

from megatron_hetero.cli.checks.attention import qwen_bench_grids, qwen_windows
from megatron_hetero.cli.checks.common import timed
from megatron_hetero.models.attention_kernels import (
    FA4,
    SDPA,
    SHORT_SEGMENTS,
    TORCH_FLASH,
    TRITON_SHORT,
    KernelChoice,
    TorchFlash,
    load_fa4,
)
from megatron_hetero.models.packed_attention import packed_heads, split_heads
from megatron_hetero.models.rope import rotate
from megatron_hetero.models.short_attention import HAVE_TRITON, WARPS, short_attention
from megatron_hetero.models.varlen import VarlenPlan, plans_to, varlen_attention
from megatron_hetero.patches import fa4_backward
from megatron_hetero.planner.families import FAMILY_BENCHES

DEVICE, BF16 = "cuda", torch.bfloat16
HEADS, HEAD_DIM, HIDDEN, FFN = 16, 80, 1280, 3424


def _cudnn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug_mask, *, scale):
    """aten._cudnn_attention_forward's varlen call in aten._flash_attention_forward's signature and outputs."""
    result = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, dropout_p,
                                                     causal, return_debug_mask, scale=scale)
    return result[0], result[1], result[6], result[7], result[8]


def _cudnn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, seed, offset, *, scale):
    """aten._cudnn_attention_backward in aten._flash_attention_backward's signature."""
    return torch.ops.aten._cudnn_attention_backward(
        grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed, philox_offset=offset,
        attn_bias=None, cum_seq_q=cu_q, cum_seq_k=cu_k, max_q=max_q, max_k=max_k, dropout_p=dropout_p,
        is_causal=causal, scale=scale)


CUDNN_VARLEN = TorchFlash(_cudnn_fwd, _cudnn_bwd)


def qwen2_5_variants(plan, scale) -> dict:
    """The kernels for Qwen2.5-VL's ViT (head dim 80), by label: fn(q, k, v)."""
    sdpa, torch_flash = KernelChoice(SDPA, HEAD_DIM, HEAD_DIM), KernelChoice(TORCH_FLASH, HEAD_DIM, HEAD_DIM)
    variants = {"sdpa grouped by shape": lambda q, k, v: varlen_attention(q, k, v, plan, sdpa, scale),
                "torch flash varlen (FA2, hd 80)": lambda q, k, v: varlen_attention(q, k, v, plan, torch_flash, scale),
                "cuDNN varlen (hd 80)": lambda q, k, v: varlen_attention(q, k, v, plan, torch_flash, scale,
                                                                         torch_flash=CUDNN_VARLEN)}
    longest = max(plan.max_q, plan.max_k)
    if HAVE_TRITON and longest <= SHORT_SEGMENTS:
        triton = KernelChoice(TRITON_SHORT, HEAD_DIM, HEAD_DIM)  # the default warps, through the layers' dispatch
        variants[f"triton short segments (hd 80, warps {WARPS[0]}/{WARPS[1]})"] = \
            lambda q, k, v: varlen_attention(q, k, v, plan, triton, scale)
        for warps in [w for w in ((4, 4), (4, 8), (8, 8), (8, 4), (2, 4)) if w != WARPS]:
            variants[f"triton short segments (hd 80, warps {warps[0]}/{warps[1]})"] = \
                lambda q, k, v, warps=warps: short_attention(q, k, v, plan.cu_q, plan.cu_k, longest, scale, warps=warps)
    if load_fa4()[0] is not None:
        fa4 = KernelChoice(FA4, HEAD_DIM, 96)
        variants["flash-attn-4 varlen (80 padded to 96)"] = lambda q, k, v: varlen_attention(q, k, v, plan, fa4, scale)
    return variants


def on_each_sdpa_backend(prefix: str, fn) -> dict:
    """fn(q, k, v) with SDPA held to each of its backends, by label "<prefix>, <backend>"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def on(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return fn(q, k, v)
        return run

    return {f"{prefix}, {name}": on(backend) for name, backend in (
        ("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FlashAttention-2", SDPBackend.FLASH_ATTENTION),
        ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION))}


def qwen3_variants(plan, scale, d: int = 72) -> dict:
    """The kernels for Qwen3-VL's ViT (head dim 72), by label: fn(q, k, v); SDPA's backends each alone."""
    sdpa, torch_flash = KernelChoice(SDPA, d, d), KernelChoice(TORCH_FLASH, d, d)
    grouped = lambda q, k, v: varlen_attention(q, k, v, plan, sdpa, scale)  # noqa: E731
    variants = {"sdpa grouped by shape (torch's pick)": grouped, **on_each_sdpa_backend("sdpa grouped", grouped),
                f"torch flash varlen (FA2, hd {d})":
                    lambda q, k, v: varlen_attention(q, k, v, plan, torch_flash, scale)}
    if load_fa4()[0] is not None:
        fa4_backward.apply()  # flash-attn-4's backward as training runs it
        for run_dim in (d, 80, 96):
            fa4 = KernelChoice(FA4, d, run_dim)
            label = f"flash-attn-4 varlen ({d}" + (" unpadded)" if run_dim == d else f" padded to {run_dim})")
            variants[label] = lambda q, k, v, fa4=fa4: varlen_attention(q, k, v, plan, fa4, scale)
    return variants


def attention_rows(name: str, cu: torch.Tensor, iters: int, head_dim: int = HEAD_DIM, kernels=qwen2_5_variants
                   ) -> list[dict]:
    plan = plans_to(DEVICE, [VarlenPlan.of(cu)])[0][0]
    total, scale = int(cu[-1]), head_dim**-0.5
    gen = torch.Generator(DEVICE).manual_seed(0)
    leaves = [torch.randn(total, HEADS, head_dim, device=DEVICE, generator=gen, dtype=BF16) for _ in range(3)]
    grad = torch.randn(total, HEADS, head_dim, device=DEVICE, generator=gen, dtype=BF16)
    variants = kernels(plan, scale)
    sdpa = KernelChoice(SDPA, head_dim, head_dim)
    # fp32 reference: the grouped SDPA path on fp32 copies
    ref_leaves = [t.float().requires_grad_() for t in leaves]
    ref = varlen_attention(*ref_leaves, plan, sdpa, scale)
    ref.backward(grad.float())
    want = [ref.detach()] + [t.grad for t in ref_leaves]
    case = dict(case=name, segments=len(cu) - 1, longest=plan.max_q, tokens=total)
    return measured_rows(case, variants, leaves, grad, want, iters)


def measured_rows(case: dict, variants: dict, leaves: list, grad, want: list, iters: int) -> list[dict]:
    """Per variant fn(q, k, v): output and gradients against `want` (fp32), forward and forward+backward ms."""
    rows = []
    for label, fn in variants.items():
        row = dict(case, variant=label)
        try:
            xs = [t.clone().requires_grad_() for t in leaves]
            out = fn(*xs)
            out.backward(grad)
            got = [out.detach()] + [t.grad for t in xs]
            row.update({f"{n}_err": ((a.float() - b).abs().max() / b.abs().max()).item()
                        for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)})
            with torch.no_grad():
                row["fwd_ms"] = timed(lambda: fn(*leaves), iters)
            row["fwd_bwd_ms"] = timed(lambda: fn(*xs).backward(grad), iters)
        except Exception as error:  # an entry this torch lacks or refuses: say so, go on
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        rows.append(row)
    return rows


def internvl_rows(iters: int) -> list[dict]:
    """InternViT's attention as its layers run it: the bench sample's tiles (1,025 tokens each, the class
    token with 32 x 32 patches) as one dense batch, 16 heads x 64, q/k/v held [tokens, tiles, heads, 64]
    (Megatron's [s, b, h, d]) and handed to the kernel as [b, s, h, d] or [b, h, s, d] views."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    vision = FAMILY_BENCHES["internvl3_8b"].config["vision_config"]
    tiles = sum(FAMILY_BENCHES["internvl3_8b"].images.values())
    seq = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
    heads, d = vision["num_attention_heads"], vision["hidden_size"] // vision["num_attention_heads"]
    gen = torch.Generator(DEVICE).manual_seed(0)
    leaves = [torch.randn(seq, tiles, heads, d, device=DEVICE, generator=gen, dtype=BF16) for _ in range(3)]
    grad = torch.randn(seq, tiles, heads, d, device=DEVICE, generator=gen, dtype=BF16)
    scale = d**-0.5

    def sdpa(q, k, v):  # [s, b, h, d] -> [b, h, s, d] views, the output back to [s, b, h, d]
        return F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), scale=scale
                                              ).permute(2, 0, 1, 3)

    ref_leaves = [t.float().requires_grad_() for t in leaves]
    with sdpa_kernel(SDPBackend.MATH):
        ref = sdpa(*ref_leaves)
    ref.backward(grad.float())
    want = [ref.detach()] + [t.grad for t in ref_leaves]
    variants = {"sdpa (torch's pick)": sdpa, **on_each_sdpa_backend("sdpa", sdpa)}
    fa4 = load_fa4()[0]
    if fa4 is not None:
        fa4_backward.apply()
        variants["flash-attn-4 dense on the [b, s] views (what auto runs)"] = lambda q, k, v: fa4.func(
            *(t.transpose(0, 1) for t in (q, k, v)), softmax_scale=scale, causal=False).transpose(0, 1)
        variants["flash-attn-4 dense, inputs copied contiguous [b, s]"] = lambda q, k, v: fa4.func(
            *(t.transpose(0, 1).contiguous() for t in (q, k, v)), softmax_scale=scale, causal=False
        ).transpose(0, 1).contiguous()
    case = dict(case="internvl3_8b tiles", segments=tiles, longest=seq, tokens=tiles * seq)
    return measured_rows(case, variants, leaves, grad, want, iters)


# ---- the glue -----------------------------------------------------------------------------------
def heads_then_pad(mixed, bias, rotary, groups, per_group, head_dim, run_dim):
    """packed_heads with the rotation's concatenation padded afterwards (another pass on GPUs)."""
    q, k, v = split_heads(mixed, bias, groups, per_group, head_dim)
    cos_q, sin_q, cos_k, sin_k = (t.flatten(1, 2) for t in rotary)
    q, k = rotate(q, cos_q, sin_q), rotate(k, cos_k, sin_k)
    return tuple(F.pad(t, (0, run_dim - head_dim)) for t in (q, k, v))


def heads_roll(mixed, bias, rotary, groups, per_group, head_dim, run_dim):
    """packed_heads with the rotation as t * cos + roll(t) * signed sin (no concatenation)."""
    q, k, v = split_heads(mixed, bias, groups, per_group, head_dim)
    cos_q, sin_q, cos_k, sin_k = (t.flatten(1, 2) for t in rotary)
    half = head_dim // 2
    sign = 1 - 2 * (torch.arange(head_dim, device=mixed.device) < half).to(mixed.dtype)
    pad = run_dim - head_dim

    def rot(t, cos, sin):
        return F.pad(t * cos + torch.roll(t, half, -1) * (sin * sign), (0, pad))

    return rot(q, cos_q, sin_q), rot(k, cos_k, sin_k), F.pad(v, (0, pad))


def kernels_per_call(fn) -> int:
    """GPU kernels one call of fn launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def glue_row(case: str, label: str, fn, inputs: list, grads, iters: int, want=None) -> dict:
    """fn(*inputs) -> tensor or tuple; forward and forward+backward time, kernels, max diff to `want`."""
    row = dict(case=case, variant=label)
    try:
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if want is not None:
            row["max_rel_diff"] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                      for a, b in zip(outs, want))

        def both():
            o = fn(*inputs)
            torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)

        with torch.no_grad():
            row["fwd_ms"] = timed(lambda: fn(*inputs), iters)
        row["fwd_bwd_ms"] = timed(both, iters)
        row["kernels_fwd_bwd"] = kernels_per_call(both)
        row["outs"] = outs
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return row


def glue_rows(tokens: int, iters: int) -> list[dict]:
    gen = torch.Generator(DEVICE).manual_seed(1)
    rand = lambda *shape, grad=True: torch.randn(*shape, device=DEVICE, generator=gen, dtype=BF16).requires_grad_(grad)  # noqa: E731
    rows = []
    mixed, bias = rand(tokens, 1, 3 * HIDDEN), rand(3 * HIDDEN)
    angles = torch.rand(tokens, 1, 1, HEAD_DIM, device=DEVICE, generator=gen) * 6
    rotary = (angles.cos().to(BF16), angles.sin().to(BF16)) * 2
    for run_dim in (96, 80):
        shape = (HEADS, 1, HEAD_DIM, run_dim)
        grads = [torch.randn(tokens, HEADS, run_dim, device=DEVICE, generator=gen, dtype=BF16) for _ in range(3)]
        reference = None
        for label, fn in (("concatenated then padded", heads_then_pad), ("pad in the concatenation", packed_heads),
                          ("roll, signed sine", heads_roll)):
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            row = glue_row(f"attention input, run head dim {run_dim}", label,
                           lambda m, b: compiled(m, b, rotary, *shape), [mixed, bias], grads, iters, reference)
            reference = reference or row.pop("outs", None)
            row.pop("outs", None)
            rows.append(row)
    x, b, residual = rand(tokens, 1, HIDDEN), rand(HIDDEN), rand(tokens, 1, HIDDEN)
    g = torch.randn(tokens, 1, HIDDEN, device=DEVICE, generator=gen, dtype=BF16)
    reference = None
    for label, fused in (("unfused (two passes)", False), ("fused (torch.compile)", True)):
        bda = get_bias_dropout_add(True, fused)
        row = glue_row("bias + dropout(0) + residual [tokens, 1, 1280]", label, lambda x, b, r: bda((x, b), r, 0.0),
                       [x, b, residual], [g], iters, reference)
        reference = reference or row.pop("outs", None)
        row.pop("outs", None)
        rows.append(row)
    y = rand(tokens, 2 * FFN)
    g = torch.randn(tokens, FFN, device=DEVICE, generator=gen, dtype=BF16)
    row = glue_row("SwiGLU [tokens, 2 x 3424]", "megatron-core's bias_swiglu_impl", lambda y: bias_swiglu_impl(y, None),
                   [y], [g], iters)
    row.pop("outs", None)
    rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--family", choices=("qwen2_5_vl_7b", "qwen3_vl_8b", "internvl3_8b"), default="qwen2_5_vl_7b")
    parser.add_argument("--windows-only", action="store_true", help="Qwen2.5-VL's windows' attention rows alone")
    args = parser.parse_args()
    if args.family == "internvl3_8b":
        write(internvl_rows(args.iters), args.out)
        return
    if args.family == "qwen3_vl_8b":
        grids = qwen_bench_grids(args.family)
        write(attention_rows("qwen3_vl_8b images", get_vision_cu_seqlens(grids).cpu().int(), args.iters, 72,
                             qwen3_variants), args.out)
        return
    grids = qwen_bench_grids()
    windows = F.pad(torch.tensor(qwen_windows()).cumsum(0), (1, 0)).int()
    rows = attention_rows("windows", windows, args.iters)
    if not args.windows_only:
        rows += attention_rows("images", get_vision_cu_seqlens(grids).cpu().int(), args.iters)
        rows += glue_rows(int(grids.prod(1).sum()), args.iters)
    write(rows, args.out)


def write(rows: list[dict], out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "vit_probe.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(dict(row, device=torch.cuda.get_device_name(), torch=torch.__version__)) + "\n")
            keys = [k for k in row if k not in ("case", "variant")]
            print(f"{row['case']} | {row['variant']} | " + ", ".join(
                f"{k} {row[k]:.4g}" if isinstance(row[k], float) else f"{k} {row[k]}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
