"""`python -m tests.small_norm_script` from the repository, with TRITON_INTERPRET=1 set before anything imports
Triton (tests/test_small_norm.py runs it so): models/small_norm.py's kernels on Triton's CPU interpreter
against torch's LayerNorm / RMSNorm in fp64: the output and x's gradient (with the residual's added, where
passed) within one rounding of their dtype and fp32's reordering, the weight's and the bias's gradients
(fp32 sums over the rows) the same. Prints, last, one JSON object: "<rows> <hidden> <dtype> <norm> <bias>
<residual>" -> [output, x's gradient, the weight's, the bias's]."""

import json
import os

import torch
import torch.nn.functional as F

from megatron_hetero.models.small_norm import ROWS, small_norm
from tests.interpreter import close

# (rows, hidden): a masked row block and columns; a whole block; one column; a ViT's width, rows past a block
SHAPES = ((ROWS + 5, 80), (ROWS, 64), (3, 1), (ROWS * 2 + 1, 1280))



def main():
    gen = torch.Generator().manual_seed(0)
    results = {}
    for rows, hidden in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for norm, has_bias in (("rms", False), ("layer", True), ("layer", False)):
                for residual in (False, True):
                    x = (torch.randn(rows, 1, hidden, generator=gen) * 2 + 0.5).to(dtype)
                    weight = torch.rand(hidden, generator=gen).add(0.5).to(dtype)
                    bias = torch.randn(hidden, generator=gen).to(dtype) if has_bias else None
                    dout, dres = (torch.randn(rows, 1, hidden, generator=gen).to(dtype) for _ in range(2))
                    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
                    got = small_norm(leaves[0], leaves[1], leaves[2], 1e-6, norm == "rms", residual)
                    outputs = got if residual else (got,)
                    torch.autograd.backward(outputs, (dout, dres)[:len(outputs)])
                    wide = [t.double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
                    if norm == "rms":
                        want = F.rms_norm(wide[0], (hidden,), wide[1], 1e-6)
                    else:
                        want = F.layer_norm(wide[0], (hidden,), wide[1], wide[2], 1e-6)
                    (want.backward(dout.double()), residual and wide[0].backward(dres.double()))
                    results[f"{rows} {hidden} {dtype} {norm} {has_bias} {residual}"] = [
                        close(outputs[0], want.detach(), 1e-4), close(leaves[0].grad, wide[0].grad, 1e-4),
                        close(leaves[1].grad, wide[1].grad, 1e-4),
                        not has_bias or close(leaves[2].grad, wide[2].grad, 1e-4)]
    results.update(module_results())
    print(json.dumps(results))


def module_results() -> dict:
    """SequenceParallelNorm (models/norm.py) with MEGATRON_HETERO_SMALL_NORM=triton on the kernels (their
    `takes` let through the CPU's tensors) against the same module on torch's kernels, fp32 on [s, b, h]:
    the output, the residual handed back, x's and every parameter's gradient. "module <norm> <zero-centered>
    <residual>" -> [the kernels ran once, all close]."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models import small_norm as kernels
    from megatron_hetero.models.kernel_policy import SMALL_NORM_ENV
    from megatron_hetero.models.norm import SequenceParallelNorm

    kernels.takes = lambda *args: True
    calls, kernel = [], kernels.small_norm
    kernels.small_norm = lambda *args: calls.append(1) or kernel(*args)
    gen = torch.Generator().manual_seed(1)
    results = {}
    for norm in ("RMSNorm", "LayerNorm"):
        for zero_centered in (False, True):
            for residual in (False, True):
                config = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=1, normalization=norm,
                                           layernorm_zero_centered_gamma=zero_centered)
                x = torch.randn(7, 2, 24, generator=gen) * 2 + 0.5
                douts = torch.randn(2, 7, 2, 24, generator=gen)
                runs = []
                calls.clear()
                for mode in ("triton", "torch"):
                    os.environ[SMALL_NORM_ENV] = mode
                    module = SequenceParallelNorm(config, 24, eps=1e-5, has_residual=residual)
                    with torch.no_grad():
                        for p in module.parameters():
                            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.2 + 1)
                    leaf = x.clone().requires_grad_()
                    out = module(leaf)
                    out, kept = out if residual else (out, leaf)
                    (out * douts[0] + kept * douts[1]).sum().backward()
                    runs.append([out, kept, leaf.grad, *(p.grad for p in module.parameters())])
                results[f"module {norm} {zero_centered} {residual}"] = [calls == [1], all(
                    torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*runs, strict=True))]
    return results


if __name__ == "__main__":
    main()
