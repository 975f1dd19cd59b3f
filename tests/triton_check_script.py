"""`python -m tests.triton_check_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_triton_check.py runs it so): `megatron-hetero kernels check triton`'s measuring
(cli/checks/triton.py) on CPU, each kind at small shapes (masked blocks, a padded and an unpadded attention
input), our kernels on Triton's interpreter and the torch paths eager, the timed calls run untimed; and
once with a kernel whose bias gradient is wrong. Prints, last, one JSON object: case -> [ok, the largest
Triton error]."""

import json

import torch

from megatron_hetero.cli.checks import common
from megatron_hetero.cli.checks import triton as check
from megatron_hetero.models import residual_add

SMALL = [check.Case("add", "add", 37, 80), check.Case("add without bias", "add without bias", 5, 24),
         check.Case("layer-scale add", "layer-scale add", 70, 48), check.Case("bias-GELU", "bias-GELU", 21, 40),
         check.Case("attention input padded", "attention input", 19, 32, 8, 16),
         check.Case("attention input", "attention input", 19, 32, 8, 8),
         check.Case("RMSNorm", "RMSNorm", 13, 40), check.Case("LayerNorm", "LayerNorm", 11, 24)]


def main():
    torch._dynamo.config.disable = True  # the torch paths eager: compiling on CPU is the tests' minutes
    check.DEVICE = "cpu"
    # CUDA events and the profiler's GPU times: the calls, no times
    common.timed = common.gpu_ms = lambda fn, iters: [fn() for _ in range(iters)] and 0.0
    cases = list(SMALL)
    # a kernel whose bias gradient is twice the right one: the check must fail it
    right = check.KINDS["add"]
    check.KINDS["wrong bias gradient"] = right._replace(
        triton=lambda c, x, b, r: residual_add.residual_add(x, b.detach() + (b - b.detach()) * 2, r))
    cases.append(check.Case("wrong bias gradient", "wrong bias gradient", 37, 80))
    results = {}
    for case in cases:
        record = check.measure(case, 1)
        errors = [v for k, v in record.items() if k.startswith("triton_") and k.endswith("_err")]
        results[case.name] = [record["ok"], max(errors)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
