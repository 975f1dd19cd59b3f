"""Is flash-attn-4 right on this GPU, at every attention shape the workloads use, and is it faster?

    megatron-hetero kernels check attention [--quick] [--workload-only] [--record] [--out DIR]
    (one GPU, flash-attn-4 importable: the fa4 extra)

1. The kernel itself (no padding; its Hopper backward as patches/fa4_backward.py leaves it, as in
   training), per head dim (64, 72, 80, 96, 128; full, causal, GQA, varlen): dq/dk/dv against fp32
   attention. The head dims where every case passes are this GPU's checked list: printed as the
   MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS line that lets the layers run flash-attn-4 there, and written
   to DIR/fa4_checked_head_dims.txt; --record writes them as this GPU's entry of the user's table
   (models/kernel_policy.py), which the kernel policy reads from then on. A head dim the table lists
   that fails here: FAIL. Part 2 uses the table's dims and those that passed here, as the policy will
   once they are recorded. --workload-only skips this part (minutes of compiles and timing) for a GPU the table lists.
2. Our dispatched attention (models/attention.py `attend`, `varlen_attention`, the kernel that
   --attention-backend auto / flash chooses, SDPA forced as the baseline) at the workloads' shapes:
   W1's LLM (2 x 32 heads x 16384 x 128, causal: the trainer's micro batch of 2, whose [s, b] memory
   order the dense FA4 call writes its output in), W1's ViT (32 images x 729 x 16 x 72), W4's ViT
   (8 x 1024 x 25 x 128), a Qwen2.5-VL-like packed ViT call (8 images of 256-9216 patches, 16 x 80,
   varlen), Qwen2.5-VL-7B's windowed call (the bench images' 419 windows of 16-64 patches: torch's
   varlen flash-attention under auto), GQA 28/4 x 128 causal at 16K, the CP2 halves of W1's
   LLM (both ranks' chunks against the gathered keys), packed documents (varlen, with and without
   CP2). One line per shape and backend: the kernel chosen, max relative errors of output and
   dq/dk/dv against fp32 attention (max |diff| / max |ref|), forward and forward+backward ms and
   TFLOPS (causal counted as half of full; backward as 2.5 x forward, FlashAttention's convention:
   x 3/3.5 for the project's model-FLOPs count). Any chosen path above the tolerance: FAIL, exit status 1.
3. A negative control: auto with head dims 72 and 80 listed as if checked, at W1's and Qwen2.5-VL's
   ViT shapes: raw flash-attn-4 4.0.0b36 failed there (GPU-KERNELS.md), showing the check catches it;
   with the backward's fix (patches/fa4_backward.py) it may pass, which the line says.
4. Our Triton kernel for short segments (models/short_attention.py) at Qwen2.5-VL-7B's windows (head
   dims 80, and 64, 72, 128) beside torch's varlen flash-attention: where every case passes, --record
   adds this GPU to the table's short-segment GPUs, on which auto runs it for windows.
Records (one JSON object per line) go to DIR/fa4_check.jsonl.
"""

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_hetero.cli.checks.common import timed
from megatron_hetero.models.attention import attend, packed_seq_params
from megatron_hetero.models.attention_kernels import (
    CHECKED_HEAD_DIMS,
    FA4,
    SDPA,
    TRITON_SHORT,
    AttentionKernelError,
    KernelChoice,
    choose_kernel,
    current_device,
    load_fa4,
)
from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.models.kernel_policy import CHECKED_ENV, SHORT_ATTENTION_CHECKED, SHORT_ATTENTION_ENV, record_check
from megatron_hetero.models.short_attention import HAVE_TRITON
from megatron_hetero.models.varlen import VarlenPlan, plans_to, varlen_attention
from megatron_hetero.patches import fa4_backward
from megatron_hetero.planner.families import FAMILY_BENCHES

TOLERANCE = 0.02  # cuDNN's bf16 gradients are 0.003-0.005 off fp32 attention, the broken ones ~1
RAW_HEAD_DIMS = (64, 72, 80, 96, 128)
BF16 = torch.bfloat16
DEVICE = "cuda"  # tests/test_attention_kernels.py runs the measuring on CPU with a stand-in kernel


# ---- cases: inputs, the call under test and its fp32 reference ------------------------------------
class Case:
    """An attention shape: q, k, v leaves [s, b, h, d] as megatron-core's attention hands them over
    (varlen: [total, h, d]), `run(kernel, q, k, v)` our call with a kernel choice, `reference(q, k, v)`
    in fp32, and its forward FLOPs; packed: a varlen call (the kernel is chosen as for one), whose
    segments have at most `longest` tokens."""

    def __init__(self, name, q_shape, kv_shape, head_dim, run, reference, flops, packed=False, longest=None):
        self.name, self.head_dim, self.run, self.reference, self.flops = name, head_dim, run, reference, flops
        self.packed, self.longest = packed, longest
        g = torch.Generator(device=DEVICE).manual_seed(0)
        self.leaves = [torch.randn(shape, generator=g, device=DEVICE, dtype=BF16).requires_grad_()
                       for shape in (q_shape, kv_shape, kv_shape)]


def _sbhd(t):
    return t.transpose(0, 1)


def _fp32_sdpa(q, k, v, **kwargs):
    """fp32 attention on [b, s, h, d] without materializing the scores (memory-efficient kernel; key
    and value heads repeated for GQA, which that kernel does not group itself)."""
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, **kwargs).transpose(1, 2)


def _fp32_sbhd(q, k, v, **kwargs):
    """_fp32_sdpa of [s, b, h, d] inputs -> [s, b, h * d], as attend returns."""
    return _sbhd(_fp32_sdpa(*map(_sbhd, (q, k, v)), **kwargs)).flatten(2)


def dense_case(name, b, s, h, hk, d, causal) -> Case:
    def run(kernel, q, k, v):
        return attend(q, k, v, kernel, d**-0.5, causal)

    def reference(q, k, v):
        return _fp32_sbhd(q, k, v, is_causal=causal)

    return Case(name, (s, b, h, d), (s, b, hk, d), d, run, reference, 4 * b * h * s * s * d * (0.5 if causal else 1))


def _documents(b, s, lengths) -> torch.Tensor:
    """[b, s] document ids, row i cut into lengths[i] (a list summing to s)."""
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) + 100 * i for i, n in enumerate(lengths)]
    assert all(len(r) == s for r in rows)
    return torch.stack(rows)


def cp_case(name, b, s, h, hk, d, cp, documents=None) -> Case:
    """Causal attention over every CP rank's query chunks against the gathered keys (one process
    playing each rank in turn), packed documents optional; outputs in sequence order."""
    packed = None if documents is None else packed_seq_params(documents, DEVICE)

    def run(kernel, q, k, v):
        out = torch.empty(s, b, h * d, device=DEVICE, dtype=q.dtype)
        for rank in range(cp):
            at = cp_positions(s, cp, rank, DEVICE)
            out = out.index_put((at,), attend(q[at], k, v, kernel, d**-0.5, True, packed=packed, cp=cp, cp_rank=rank))
        return out

    def reference(q, k, v):
        if packed is None:
            return _fp32_sbhd(q, k, v, is_causal=True)
        same = packed.seq_idx[:, :, None] == packed.seq_idx[:, None, :]
        return _fp32_sbhd(q, k, v, attn_mask=(same & torch.ones(s, s, dtype=torch.bool, device=DEVICE).tril())[:, None])

    keys = b * s * s / 2 if documents is None else sum(n * n / 2 for n in _run_lengths(documents))
    return Case(name, (s, b, h, d), (s, b, hk, d), d, run, reference, 4 * h * keys * d)


def _run_lengths(documents) -> list[int]:
    return torch.unique_consecutive(documents.flatten(), return_counts=True)[1].tolist()


def varlen_case(name, lengths, h, d) -> Case:
    """A packed ViT call: full attention within each image of `lengths` tokens."""
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(dtype=torch.int32)
    plan = plans_to(DEVICE, [VarlenPlan.of(cu)])[0][0]  # planned once for every layer, as the ViTs do

    def run(kernel, q, k, v):
        return varlen_attention(q, k, v, plan, kernel, d**-0.5)

    def reference(q, k, v):
        bounds = cu.tolist()
        return torch.cat([_fp32_sdpa(*(t[a:e][None] for t in (q, k, v)))[0] for a, e in zip(bounds, bounds[1:])])

    total = sum(lengths)
    return Case(name, (total, h, d), (total, h, d), d, run, reference, sum(4 * h * n * n * d for n in lengths),
                packed=True, longest=max(lengths))


def qwen_bench_grids(family: str = "qwen2_5_vl_7b") -> torch.Tensor:
    """The patch grids [images, 3] (t, h, w) of a Qwen family's bench images (its presets.json)."""
    return torch.tensor([[1, *grid] for grid in FAMILY_BENCHES[family].images.values()])


def qwen_windows() -> list[int]:
    """The window lengths of Qwen2.5-VL-7B's bench images, in its layers' order (transformers' window
    index, at the preset's window, patch and merge sizes)."""
    from transformers.vision_utils import get_vision_window_index

    vision = FAMILY_BENCHES["qwen2_5_vl_7b"].config["vision_config"]
    windows = get_vision_window_index(qwen_bench_grids(), vision["spatial_merge_size"], vision["window_size"],
                                      vision["patch_size"])[1]
    return windows.diff().tolist()


def workload_cases(quick: bool) -> list[Case]:
    s = 4096 if quick else 16384
    qwen, windows = [256, 1024, 4096, 9216, 576, 2304, 784, 6400], qwen_windows()
    return [
        dense_case(f"W1 LLM 2x32x{s}x128 causal", 2, s, 32, 32, 128, True),
        dense_case("W1 ViT 32 images x 729 x 16 x 72", 32, 729, 16, 16, 72, False),
        dense_case("W4 ViT 8 x 1024 x 25 x 128", 8, 1024, 25, 25, 128, False),
        varlen_case(f"Qwen2.5-VL ViT varlen {len(qwen)} images 16 x 80", qwen[:4] if quick else qwen, 16, 80),
        varlen_case(f"Qwen2.5-VL-7B ViT's {len(windows)} windows 16 x 80", windows, 16, 80),
        dense_case(f"GQA 28/4 x 128 causal {s}", 1, s, 28, 4, 128, True),
        cp_case(f"CP2 halves 1x32x{s}x128", 1, s, 32, 32, 128, 2),
        cp_case("packed docs 2x8192 GQA 32/8 x 128", 2, 8192, 32, 8, 128, 1,
                _documents(2, 8192, [[3000, 5000, 192], [1000, 7192]])),
        cp_case("packed docs CP2 2x8192 GQA 32/8 x 128", 2, 8192, 32, 8, 128, 2,
                _documents(2, 8192, [[3000, 5000, 192], [1000, 7192]])),
    ]


def raw_cases(d: int) -> list[Case]:
    """The kernel's own cases at one head dim (attention_grad_check.py's shapes)."""
    return [dense_case(f"raw hd{d} full 8x1024 h4", 8, 1024, 4, 4, d, False),
            dense_case(f"raw hd{d} causal 4096 h8", 1, 4096, 8, 8, d, True),
            dense_case(f"raw hd{d} GQA 28/4 causal 2048", 1, 2048, 28, 4, d, True),
            varlen_case(f"raw hd{d} varlen 4 images", [256, 1024, 576, 784], 4, d)]


# ---- measuring ---------------------------------------------------------------------------------------
def errors(case: Case, kernel: KernelChoice) -> list[float]:
    """max |ours - fp32| / max |fp32| of the output, dq, dk, dv (the reference from fp32 copies)."""
    results, g = [], None
    for fn, dtype in ((case.reference, torch.float32), (lambda *x: case.run(kernel, *x), BF16)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in case.leaves]
        out = fn(*leaves)
        if g is None:
            g = torch.randn(out.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        (out.float() * g).sum().backward()
        results.append([out.detach().float()] + [x.grad.float() for x in leaves])
    want, got = results
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]


def speed(case: Case, kernel: KernelChoice, iters: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms)."""
    q, k, v = case.leaves
    with torch.no_grad():
        fwd = timed(lambda: case.run(kernel, q, k, v), iters)
    out = case.run(kernel, q, k, v)
    g = torch.randn_like(out)
    return fwd, timed(lambda: case.run(kernel, q, k, v).backward(g), iters)


def measure(case: Case, label: str, kernel: KernelChoice, iters: int, judged: bool = True) -> dict:
    """Errors (and with iters, speed) of our call with `kernel`; one line. judged: a chosen path (a
    failure fails the check); else informational (raw kernels at head dims never chosen, the control)."""
    errs = errors(case, kernel)
    ok = max(errs) <= TOLERANCE
    record = dict(shape=case.name, backend=label, kernel=str(kernel), out_err=errs[0], dq_err=errs[1], dk_err=errs[2],
                  dv_err=errs[3], ok=ok, judged=judged)
    line = (f"{case.name} | {label}: {kernel} | rel err out {errs[0]:.2g} dq {errs[1]:.2g} dk {errs[2]:.2g} "
            f"dv {errs[3]:.2g}")
    if iters:
        fwd, both = speed(case, kernel, iters)
        record.update(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=case.flops / fwd / 1e9,
                      fwd_bwd_tflops=3.5 * case.flops / both / 1e9)
        line += (f" | fwd {fwd:.3f} ms ({record['fwd_tflops']:.0f} TFLOPS), fwd+bwd {both:.3f} ms "
                 f"({record['fwd_bwd_tflops']:.0f})")
    print(f"{line} | {('ok' if ok else 'FAIL') if judged else ('passes' if ok else 'fails')}", flush=True)
    return record


# ---- the three parts -----------------------------------------------------------------------------
def raw_check(records: list) -> tuple[tuple[int, ...], bool]:
    """Part 1: (the head dims where raw flash-attn-4 passes every case, whether the table agrees)."""
    device = current_device()
    listed = CHECKED_HEAD_DIMS.get(device.name, ())
    passing = []
    for d in RAW_HEAD_DIMS:
        raw = KernelChoice(FA4, d, d)
        results = [measure(case, "raw fa4", raw, 0, judged=d in listed) for case in raw_cases(d)]
        records += results
        if all(r["ok"] for r in results):
            passing.append(d)
    wrong = sorted(set(listed) - set(passing))
    print(f"head dims whose flash-attn-4 gradients pass on {device.name}: {passing}; the checked table lists "
          f"{list(listed) or 'none'}" + (f"; FAIL: listed but wrong here: {wrong}" if wrong else ""))
    return tuple(passing), not wrong


def _fa4_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "?"


def cudnn_speed(case: Case, iters: int) -> None:
    """SDPA with torch's cuDNN kernel forced: is torch's own pick (the sdpa line) cuDNN?"""
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fwd, both = speed(case, KernelChoice(SDPA, case.head_dim, case.head_dim), iters)
        print(f"{case.name} | sdpa, cuDNN forced: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)
    except Exception as error:  # no cuDNN kernel for this mask or shape: torch says so in its own words
        print(f"{case.name} | sdpa, cuDNN forced: {str(error).splitlines()[0][:100]}", flush=True)


def workload_check(records: list, checked: tuple[int, ...], quick: bool, iters: int) -> bool:
    """Part 2: every workload shape under SDPA, auto and flash; whether every chosen path passes."""
    device, ok = current_device(), True
    for case in workload_cases(quick):
        for mode in (SDPA, "auto", "flash"):
            try:
                kernel = choose_kernel(mode, case.head_dim, device, checked=checked, packed=case.packed,
                                       longest=case.longest,
                                       torch_flash=torch.backends.cuda.is_flash_attention_available(),
                                       short_checked=device.name in SHORT_ATTENTION_CHECKED, triton=HAVE_TRITON)
            except AttentionKernelError as error:
                print(f"{case.name} | {mode}: not run: {error}", flush=True)
                continue
            records.append(measure(case, mode, kernel, iters))
            ok &= records[-1]["ok"]
        cudnn_speed(case, iters)
        torch.cuda.empty_cache()
    return ok


def negative_control(records: list, checked: tuple[int, ...]) -> None:
    """Part 3: head dims 72 and 80 taken as checked: auto runs raw flash-attn-4 there, and the check
    must see it (GPU-KERNELS.md: wrong gradients at both with 4.0.0b36 on the H100)."""
    device = current_device()
    for case in (dense_case("control: W1 ViT 32 x 729 x 16 x 72", 32, 729, 16, 16, 72, False),
                 varlen_case("control: Qwen2.5-VL ViT varlen 16 x 80", [256, 1024, 4096, 576], 16, 80)):
        kernel = choose_kernel("auto", case.head_dim, device, checked=tuple(sorted({*checked, 72, 80})))
        records.append(measure(case, "auto, 72/80 as if checked", kernel, 0, judged=False))
        caught = not records[-1]["ok"]
        print(f"negative control at head dim {case.head_dim}: " + (
            "the check fails this path, as it must" if caught else
            "raw flash-attn-4 passes here (a fixed wheel, or patches/fa4_backward.py's fix): the control did not "
            "trigger"), flush=True)


def short_check(records: list, iters: int) -> bool:
    """Part 4: our Triton kernel for short segments at the windows' shapes; whether every case passes
    (False where Triton does not import)."""
    device, windows = current_device(), qwen_windows()
    if not HAVE_TRITON:
        print("short segments: Triton does not import here: windows keep torch's varlen flash-attention", flush=True)
        return False
    ok = True
    for d in (80, 64, 72, 128):
        case = varlen_case(f"Qwen2.5-VL-7B ViT's {len(windows)} windows 16 x {d}", windows, 16, d)
        kernel = choose_kernel("auto", d, device, packed=True, longest=case.longest, short_mode="triton", triton=True)
        records.append(measure(case, "triton short segments", kernel, iters))
        ok &= records[-1]["ok"] and kernel.kernel == TRITON_SHORT
    return ok


def _next_step(device_name: str, passing: tuple[int, ...], recorded: Path | None) -> str:
    """What to do with part 1's result."""
    if recorded:
        return f"recorded {device_name}'s head dims {list(passing)} in {recorded}: the kernel policy reads them"
    if not passing:
        return f"no head dim passes on {device_name}: the layers keep torch SDPA there"
    return (f"to run flash-attn-4 at these head dims on {device_name}: export {CHECKED_ENV}="
            f"{','.join(map(str, passing))} (or run again with --record to keep them)")


def main(quick: bool, out: str, record: bool, workload_only: bool) -> int:
    fa4_backward.apply()  # flash-attn-4's backward as training runs it
    device = current_device()
    if load_fa4()[0] is None or device.capability is None:
        print(f"error: {load_fa4()[1] or 'no GPU visible'}")
        return 2
    if workload_only and device.name not in CHECKED_HEAD_DIMS:
        print(f"error: --workload-only: the checked table has no entry for {device.name}; run without it once")
        return 2
    print(f"{device.name} sm{device.capability[0]}{device.capability[1]}, torch {torch.__version__}, "
          f"flash-attn-4 {_fa4_version()}", flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    records, passing, table_ok, recorded = [], (), True, None
    if not workload_only:
        passing, table_ok = raw_check(records)
        (Path(out) / "fa4_checked_head_dims.txt").write_text(",".join(map(str, passing)) + "\n")
        if record:
            recorded = record_check(device.name, fa4_head_dims=passing)
    # What the policy runs once part 1 is recorded: the table's head dims and those passing here.
    checked = tuple(sorted({*CHECKED_HEAD_DIMS.get(device.name, ()), *passing}))
    ok = workload_check(records, checked, quick, 3 if quick else 10)
    negative_control(records, checked)
    short_ok = short_check(records, 3 if quick else 10)
    with open(Path(out) / "fa4_check.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps(dict(r, device=device.name, date=time.strftime("%Y-%m-%d"))) + "\n")
    print(f"{'PASS' if ok and table_ok else 'FAIL'}: chosen paths within {TOLERANCE} of fp32 attention"
          + ("" if table_ok else "; the checked table lists a head dim that fails here"))
    if not workload_only:
        print(_next_step(device.name, passing, recorded))
    if short_ok and record:
        print(f"recorded {device.name} in {record_check(device.name, short_attention=True)}: auto runs windows on "
              f"the Triton kernel there")
    elif short_ok and device.name not in SHORT_ATTENTION_CHECKED:
        print(f"the Triton kernel for short segments passed: run again with --record, or export {SHORT_ATTENTION_ENV}"
              f"=triton")
    elif not short_ok and device.name in SHORT_ATTENTION_CHECKED:
        print(f"FAIL: {device.name} is among the table's short-segment GPUs but the Triton kernel failed here")
        return 1
    return 0 if ok and table_ok else 1
