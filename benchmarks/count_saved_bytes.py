"""What a family's vision layers keep for their backward, counted on the CPU: the bytes of every tensor
autograd saves during the forward (each storage once, weights left out), per token and layer, by the
module that saved it, to compare with the planner's count (planner/counts.py,
activation_bytes_per_token_layer).

    python benchmarks/count_saved_bytes.py [--family qwen3_vl_8b] [--layers 2] [--order sorted|shuffled]
        [--dtype bfloat16]

Builds a native-resolution tower (Qwen2.5-VL's, Qwen3-VL's) at the preset's widths, `--layers` deep
(count_vit_ops.family_sizes), and runs it on count_vit_ops' four images, from the smallest up as the
families' samples list theirs (`sorted`: SDPA's packed path needs no permutation) or as count_vit_ops
orders them (`shuffled`). On SDPA as the CPU runs it: torch's CPU attention kernel keeps what the
GPU's flash kernel keeps (Q, K, V, the output and its log-sum-exp), but torch's RMSNorm on the CPU
keeps fp32 copies that the GPU's fused kernel does not.
"""

import argparse
import collections
import re
import sys

import torch
from count_vit_ops import family_sizes, groups, one_process

SIZES = {"sorted": [(4, 4), (8, 8), (12, 6), (7, 11)], "shuffled": [(8, 8), (7, 11), (12, 6), (4, 4)]}


def batch(encoder, vision: dict, order: str, dtype):
    """The encoder's forward on four images of several sizes, as a call."""
    merge = vision["spatial_merge_size"]
    grids = torch.tensor([[1, h * merge, w * merge] for h, w in SIZES[order]])
    patches = torch.randn(int(grids.prod(1).sum()), encoder.arch.patch_dim, dtype=dtype)
    return lambda: encoder(patches, grids)


def saved_bytes(name: str, layers: int, order: str, dtype) -> tuple[int, dict]:
    """(tokens through each layer, {(module, dtype): bytes its layers save}) of one forward."""
    family, sizes, vision = family_sizes(name, layers)
    encoder = family.build_vision(sizes, 1, groups(name, "encoder"), dtype, whole=True)
    forward = batch(encoder, vision, order, dtype)
    forward().sum().backward()  # first call: lazy initializations out of the count
    weights = {p.untyped_storage().data_ptr() for p in encoder.parameters()}
    where, handles = ["step"], []

    def leave(module, args, out):
        where.pop()  # returns None: the module's output stays

    for module_name, module in encoder.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, args, n=module_name: where.append(n)))
        handles.append(module.register_forward_hook(leave))
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen.setdefault(storage.data_ptr(), (re.sub(r"layers\.\d+", "layers.*", where[-1]), t.dtype,
                                                 storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    for handle in handles:
        handle.remove()
    kept = collections.Counter()
    for module, saved_dtype, nbytes in seen.values():
        if ".layers.*" in module:
            kept[(module.split(".layers.*.")[-1], str(saved_dtype))] += nbytes
    return sum(h * w for h, w in SIZES[order]) * vision["spatial_merge_size"] ** 2, kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_vl_8b", help="a family preset (families/<name>/presets.json)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--order", choices=sorted(SIZES), default="sorted")
    parser.add_argument("--dtype", default="bfloat16")
    opts = parser.parse_args()

    one_process(29534)
    tokens, kept = saved_bytes(opts.family, opts.layers, opts.order, getattr(torch, opts.dtype))
    for (module, saved_dtype), nbytes in sorted(kept.items()):
        print(f"{module:40s} {saved_dtype:15s} {nbytes / tokens / opts.layers:9.1f} bytes per token and layer")
    print(f"{opts.family} ({opts.order}, {tokens} tokens): {sum(kept.values()) / tokens / opts.layers:.1f} bytes per "
          "token and layer")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
