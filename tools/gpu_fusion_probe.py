"""Would quack's GEMM epilogues (GELU in the fc1 GEMM, its gradient in the fc2 input-gradient GEMM)
make the MLP faster than cuBLAS plus torch's GELU kernels, at W1's shapes? Measured before building it.

    python3 tools/gpu_fusion_probe.py [--swiglu] [--out DIR]   (one Hopper GPU, quack importable: the fa4 extra)

Per shape (W1's LLM MLP: 32768 tokens x 4096 -> 16384; its SigLIP ViT's: 23328 x 1152 -> 4304 padded
to 4608 as the profile's GEMMs are), bf16, CUDA events over ITERS calls after warm-up:
- forward: cuBLAS x @ w1^T then F.gelu (erf), against quack's gemm_act (activation gelu_erf, the
  pre-activation stored for the backward);
- backward through the activation: cuBLAS dout @ w2 then torch's GELU backward, against quack's
  gemm_dact (which also writes the recomputed GELU output, the fc2 weight gradient's input);
- the residual add before a LayerNorm: torch's add then its norm, against quack's norm with the
  residual fused (it writes the sum for the next residual and the normalized output);
- the plain GEMMs alone (cuBLAS against quack's gemm), forward orientation, to separate the GEMM's
  own speed from the fusion's;
- GELU alone, forward and backward: torch's kernels against inductor's (torch.compile), the same erf
  formula, for when the epilogues cannot run.
With --swiglu instead, gated MLPs (the Qwen families' LLMs; megatron-core keeps fc1's output as
[gate; up] halves and, without --bias-swiglu-fusion, runs the gate eagerly): cuBLAS then torch's
silu(gate) * up (forward) and its autograd backward, against quack's gemm_act / gemm_dact with the
swiglu epilogue on [gate; up] weights (concat_layout, as quack's own gated MLP calls them); the fused
forward's output and the backward's recomputed output compared, the gradient's layout being quack's;
and that gradient back to [gate; up] halves, torch's strided copy against models/mlp_kernels.py's
Triton copy of whole (gate, up) pairs (max rel diff: 0 where the bits are equal, else 1).
Each fused result's max |diff| / max |ref| against the unfused bf16 one. One JSON line per row to
DIR/fusion_probe.jsonl (DIR: $OUT or out/).

quack's epilogue GEMMs compile only where nvidia-cutlass-dsl is imported from a site-packages directory
(models/mlp_kernels.py; benchmarks/gpu_env.sh links FA4_SITE so): from a `pip --target` directory every
epilogue row failed (2026-11-27).
"""

import argparse
import functools
import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_hetero.cli.checks.common import timed
from megatron_hetero.models.mlp_kernels import ACTIVATIONS, halves_by_words, strided_halves

ITERS = 30
SHAPES = {"W1 LLM MLP": (32768, 4096, 16384), "W1 ViT MLP": (23328, 1152, 4608)}
GATED_SHAPES = {"Qwen2.5-VL-7B LLM MLP": (32768, 3584, 18944), "Qwen3-VL-8B LLM MLP": (32768, 4096, 12288)}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def _add_norm_torch(x, residual, weight):
    total = x + residual
    return F.layer_norm(total, total.shape[-1:], weight, weight, 1e-5), total


def _add_norm_quack(x, residual, weight, norm):
    out, total = torch.empty_like(x), torch.empty_like(x)
    rows = x.shape[0]
    stats = [torch.empty(rows, device=x.device, dtype=torch.float32) for _ in range(2)]
    norm._rmsnorm_fwd(x, weight, out, weight, stats[0], stats[1], residual, total, 1e-5, True)
    return out, total


def _row(name: str, what: str, torch_fn, fused_fn, compare, candidate: str = "quack") -> dict:
    """One comparison timed, checked and printed: torch's path against `candidate`'s (an error in the
    candidate's is recorded and printed in its place)."""
    record = dict(shape=name, what=what, candidate=candidate, torch_ms=timed(torch_fn, ITERS),
                  device=torch.cuda.get_device_name(), torch=torch.__version__)
    try:
        record.update(candidate_ms=timed(fused_fn, ITERS), max_rel_diff=compare())
    except Exception as error:  # e.g. quack's epilogues with the DSL outside site-packages (docs/runs/benchmarks.md)
        record["candidate_error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:150]}"
    cells = (f"{record['candidate_ms']:.3f} | {record['torch_ms'] / record['candidate_ms']:.3f} | "
             f"{record['max_rel_diff']:.4f}" if "candidate_ms" in record else f"{record['candidate_error']} | |")
    print(f"| {name} | {what} | {record['torch_ms']:.3f} | {candidate}: {cells} |", flush=True)
    return record


def probe(name: str, tokens: int, hidden: int, ffn: int, quack, norm) -> list[dict]:
    """The comparisons at one shape; quack: quack.gemm_interface, norm: quack.rmsnorm."""
    torch.manual_seed(0)
    x, w1, w2 = _randn(tokens, hidden), _randn(ffn, hidden, scale=hidden**-0.5), _randn(hidden, ffn, scale=ffn**-0.5)
    dout, dact = _randn(tokens, hidden), _randn(tokens, ffn)
    pre = x @ w1.t()
    gelu, gelu_backward = torch.compile(F.gelu), torch.compile(torch.ops.aten.gelu_backward)
    return [
        _row(name, "fc1 GEMM + GELU forward", lambda: F.gelu(x @ w1.t()),
             lambda: quack.gemm_act(x, w1.t(), activation="gelu_erf", tuned=False),
             lambda: _rel(quack.gemm_act(x, w1.t(), activation="gelu_erf", tuned=False)[1], F.gelu(pre))),
        _row(name, "fc2 input gradient + GELU backward", lambda: torch.ops.aten.gelu_backward(dout @ w2, pre),
             lambda: quack.gemm_dact(dout, w2, pre, activation="gelu_erf", tuned=False),
             lambda: _rel(quack.gemm_dact(dout, w2, pre, activation="gelu_erf", tuned=False)[0],
                          torch.ops.aten.gelu_backward(dout @ w2, pre))),
        _row(name, "residual add + LayerNorm forward", lambda: _add_norm_torch(x, dout, w2[:, 0]),
             lambda: _add_norm_quack(x, dout, w2[:, 0].contiguous(), norm),
             lambda: _rel(_add_norm_quack(x, dout, w2[:, 0].contiguous(), norm)[0],
                          _add_norm_torch(x, dout, w2[:, 0])[0])),
        _row(name, "fc1 GEMM alone", lambda: x @ w1.t(), lambda: quack.gemm(x, w1.t(), tuned=False),
             lambda: _rel(quack.gemm(x, w1.t(), tuned=False), pre)),
        _row(name, "GELU forward alone", lambda: F.gelu(pre), lambda: gelu(pre), lambda: _rel(gelu(pre), F.gelu(pre)),
             "inductor"),
        _row(name, "GELU backward alone", lambda: torch.ops.aten.gelu_backward(dact, pre),
             lambda: gelu_backward(dact, pre),
             lambda: _rel(gelu_backward(dact, pre), torch.ops.aten.gelu_backward(dact, pre)), "inductor"),
    ]


def probe_gated(name: str, tokens: int, hidden: int, ffn: int, quack) -> list[dict]:
    """The swiglu comparisons at one shape (fc1 [2 ffn, hidden] as [gate; up], fc2 [hidden, ffn])."""
    torch.manual_seed(0)
    x, w1 = _randn(tokens, hidden), _randn(2 * ffn, hidden, scale=hidden**-0.5)
    w2, dout = _randn(hidden, ffn, scale=ffn**-0.5), _randn(tokens, hidden)
    pre = (x @ w1.t()).requires_grad_()
    swiglu = ACTIVATIONS["swiglu"]  # megatron-core's gated unit on [gate; up] halves
    post = swiglu(pre)  # the graph the torch backward runs through, again each call

    def fused_forward():
        return quack.gemm_act(x, w1.t(), activation="swiglu", concat_layout=("B",), tuned=False)

    fused_preact = functools.cache(lambda: fused_forward()[0])  # in quack's own layout, from its forward

    def fused_backward():
        return quack.gemm_dact(dout, w2, fused_preact(), activation="swiglu", tuned=False)

    dpreact = functools.cache(lambda: fused_backward()[0])  # the gradient as quack writes it: interleaved

    return [
        _row(name, "fc1 GEMM + SwiGLU forward", lambda: swiglu(x @ w1.t()), fused_forward,
             lambda: _rel(fused_forward()[1], post.detach())),
        _row(name, "fc2 input gradient + SwiGLU backward",
             lambda: torch.autograd.grad(post, pre, dout @ w2, retain_graph=True), fused_backward,
             lambda: _rel(fused_backward()[1], post.detach())),
        _row(name, "its gradient to [gate; up] halves (copy)", lambda: strided_halves(dpreact()),
             lambda: halves_by_words(dpreact()),
             lambda: float(not torch.equal(halves_by_words(dpreact()), strided_halves(dpreact()))), "triton"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--swiglu", action="store_true", help="the gated MLPs' rows instead (above)")
    args = parser.parse_args()
    try:
        import quack.gemm_interface as quack

        norm = importlib.import_module("quack.rmsnorm")  # `import quack.rmsnorm` gets quack's rmsnorm function
    except Exception as error:
        print(f"error: quack does not import ({type(error).__name__}: {error})")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {ITERS} calls each")
    print("| shape | what | cuBLAS + torch ms | candidate: ms | speed-up | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    if args.swiglu:
        rows = [r for name, shape in GATED_SHAPES.items() for r in probe_gated(name, *shape, quack)]
    else:
        rows = [r for name, shape in SHAPES.items() for r in probe(name, *shape, quack, norm)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "fusion_probe.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
