"""examples/pretrain_vlm.py with the forward time of megatron-core's MoE token dispatcher measured:
every dispatch (permute, all-to-all, expert-TP gather) and combine (reduce-scatter, all-to-all,
unpermute) of every MoE layer, CUDA-synchronized on both sides (which slows the run a little; the
backward all-to-alls are not in it). At the end each rank prints its seconds per training iteration.

    torchrun --nproc-per-node 2 benchmarks/time_moe_dispatch.py --hetero-layout ... --num-experts ...
"""

import os
import runpy
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain_vlm.py"
STEPS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
         "combine_preprocess", "token_combine", "combine_postprocess")


def _timed(method, spent: dict):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = method(*args, **kwargs)
        torch.cuda.synchronize()
        spent["s"] += time.perf_counter() - start
        return result
    return wrapper


def main() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    spent = {"s": 0.0}
    for name in STEPS:
        setattr(MoEAlltoAllTokenDispatcher, name, _timed(getattr(MoEAlltoAllTokenDispatcher, name), spent))
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    start = time.perf_counter()
    runpy.run_path(str(SCRIPT), run_name="__main__")
    from megatron.training import get_args

    iters = get_args().train_iters
    print(f"rank {os.environ.get('RANK', 0)}: MoE dispatch+combine forward {spent['s'] / iters * 1e3:.1f} ms "
          f"per iteration over {iters} iterations ({spent['s'] / (time.perf_counter() - start):.1%} of the run)",
          flush=True)


if __name__ == "__main__":
    main()
