"""Host work of the families' packed ViTs, counted on the CPU: the operators each layer dispatches
(a proxy for GPU kernel launches) and the host synchronizations, forward and backward.

    python benchmarks/count_vit_ops.py [--family qwen2_5_vl_7b qwen3_vl_8b] [--layers 4] [--llm] [--ops]
        [--json out.json]

Builds each family's vision tower at its preset's widths (families/<name>/presets.json) with a
shallow depth (Qwen2.5-VL: full attention in layers 1 and 3, windows in 0 and 2; Qwen3-VL: DeepStack
mergers after layers 1 and 2), float32 on the CPU, one process, and runs it forward and backward
on one packed batch of four images of several sizes (edge windows included). Every ATen operator
is counted where it is dispatched (below autograd: a composite such as `linear` counts as the
kernels it runs) and attributed to a region: `plan` (the layout planned on the host from the grids),
`layer i` (forward: the layer's own call; backward: the autograd nodes its forward made), and
`step` (the rest: patch embedding, rotary table, mergers, permutation). Views and allocations are
counted apart: they launch no kernel. Host synchronizations, which on a GPU hold the host until
the device catches up: reads of a tensor's values into Python (`item`, `tolist`, `bool`, `int`,
`numpy`, `cpu`) and the operators whose output size depends on values (`nonzero`, `unique`,
`masked_select`, `repeat_interleave` of a tensor of repeats without its output size). In the
`plan` region these read the host's own grids (no device is involved); elsewhere each is a
synchronization on a GPU. Counts, not timings: the same on any host.

--llm counts each family's LLM the same way (`count_llm`: its layers at a small width, an image's
rows, M-RoPE positions and DeepStack blocks through models/vlm.llm_forward to the per-token losses).
"""

import argparse
import collections
import json
import os
import sys
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that launch nothing on a GPU: views, and allocations without a fill.
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_unsafe_view", "set_", "resize_", "_reshape_alias"}
# Operators whose output size depends on the values: on a GPU, the host waits for the device.
SYNC_OPS = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
            "masked_select", "nonzero_static"}
LAYOUT_OPS = {"copy_", "clone", "_to_copy", "cat", "stack", "index_select", "gather", "scatter", "index",
              "constant_pad_nd", "index_put_", "_index_put_impl_", "scatter_add", "index_add", "split_with_sizes_copy"}
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_efficient_attention_backward"}
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu"}


def op_kind(func) -> str:
    name = func._overloadpacket.__name__
    if name in SYNC_OPS:
        return "sync"
    if func.is_view or name in NO_KERNEL:
        return "view"
    if name in MATMUL_OPS:
        return "matmul"
    if name in LAYOUT_OPS:
        return "copy"
    return "elementwise"


class Counts(TorchDispatchMode):
    """ATen operators by (phase, region, kind, name); the region and phase set from outside."""

    def __init__(self):
        super().__init__()
        self.phase, self.region = "forward", "step"
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kind = func._overloadpacket.__name__, op_kind(func)
        if func is torch.ops.aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None:
            kind = "sync"  # a tensor of repeats: the output's size is read from the device
        self.ops[(self.phase, self.region, kind, name)] += 1
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """Reads of tensor values into Python (Counts' regions); torch functions, not ATen operators."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor):
            self.counts.ops[(self.counts.phase, self.counts.region, "host read", name)] += 1
        return func(*args, **(kwargs or {}))


def _nodes(roots, seen: set) -> list:
    """The autograd nodes reachable from `roots` not in `seen` (added to it)."""
    found, stack = [], [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        found.append(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


@contextmanager
def regions(counts: Counts, layers, module=None):
    """Forward regions by hooks on the `layers` (`plan` by wrapping `module`'s grid_layout, a
    family's vision module); each region's outputs kept, so that after the forward its autograd
    nodes get prehooks that set the backward's region (`tag_backward`)."""
    outputs = []
    handles = []

    def enter(name):
        def hook(mod, args, kwargs):
            if not outputs:  # the first layer's input: what the step did before the layers
                outputs.append(("step", kwargs.get("hidden_states", args[0] if args else None)))
            counts.region = name
        return hook

    def leave(name):
        def hook(mod, args, out):
            outputs.append((name, out[0] if isinstance(out, tuple) else out))
            counts.region = "step"
        return hook

    for index, layer in enumerate(layers):
        handles += [layer.register_forward_pre_hook(enter(f"layer {index}"), with_kwargs=True),
                    layer.register_forward_hook(leave(f"layer {index}"))]
    if module is None:
        yield outputs
        for handle in handles:
            handle.remove()
        return
    original = module.grid_layout

    def planned(*args, **kwargs):
        counts.region = "plan"
        try:
            return original(*args, **kwargs)
        finally:
            counts.region = "step"
    module.grid_layout = planned
    try:
        yield outputs
    finally:
        module.grid_layout = original
        for handle in handles:
            handle.remove()


def tag_backward(counts: Counts, outputs, final: torch.Tensor) -> list:
    """Node prehooks setting the backward's region: a layer's nodes are those its output reaches
    that no earlier region's output reaches (regions walked in forward order); the rest `step`."""
    seen, handles = set(), []

    def setter(name):
        def hook(grad_outputs):
            counts.region = name
        return hook
    for name, out in [*outputs, ("step", final)]:
        for node in _nodes([out.grad_fn], seen):
            handles.append(node.register_prehook(setter(name)))
    return handles


# The LLM's widths on the CPU (operators do not depend on them): head size 128, as the presets'.
SMALL_TEXT = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=128, vocab_size=1024)


def family_sizes(name: str, layers: int, small_text: bool = False):
    """(the family, its ModelSizes at preset `name`'s widths with `layers` vision and LLM layers
    (the LLM at SMALL_TEXT's widths where `small_text`), its vision config)."""
    from transformers import AutoConfig

    from megatron_hetero.families import family_named
    from megatron_hetero.planner.families import FAMILY_BENCHES

    bench = FAMILY_BENCHES[name]
    vision = dict(bench.config["vision_config"], depth=layers)
    text = dict(bench.config["text_config"], num_hidden_layers=layers, **(SMALL_TEXT if small_text else {}))
    if small_text:
        vision["out_hidden_size"] = SMALL_TEXT["hidden_size"]
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = list(range(1, layers, 2))
    if "deepstack_visual_indexes" in vision:
        vision["deepstack_visual_indexes"] = list(range(1, min(3, layers)))
    family = family_named(bench.model_type)
    sizes = family.sizes(AutoConfig.for_model(bench.model_type, **{**bench.config, "vision_config": vision,
                                                                     "text_config": text}))
    return family, sizes, vision


def groups(name: str, role: str):
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.spec.layout import ModuleLayout

    return build_module_groups(ModuleLayout(f"count_{name}_{role}", role)).pgs


def family_encoder(name: str, layers: int):
    """(the family's vision tower at preset `name`'s widths and `layers` deep, its vision module,
    its vision config)."""
    family, sizes, vision = family_sizes(name, layers)
    encoder = family.build_vision(sizes, 1, groups(name, "encoder"), torch.float32, whole=True)
    return encoder, sys.modules[type(encoder).__module__], vision


def packed_batch(encoder, vision: dict, seed: int = 0):
    """Four images of 8x8, 7x11, 12x6 and 4x4 merge blocks: (patches, grids)."""
    merge = vision["spatial_merge_size"]
    blocks = [(8, 8), (7, 11), (12, 6), (4, 4)]
    grids = torch.tensor([[1, h * merge, w * merge] for h, w in blocks])
    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(int(grids.prod(1).sum()), encoder.arch.patch_dim, generator=g)
    return patches, grids


def count(name: str, layers: int) -> dict:
    encoder, module, vision = family_encoder(name, layers)
    patches, grids = packed_batch(encoder, vision)
    encoder(patches, grids).sum().backward()  # first call: lazy initializations out of the counts
    return counted(name, encoder.decoder.layers, lambda: encoder(patches, grids), module)


def counted(name: str, layers, forward, module=None) -> dict:
    """The counts of `forward`() and its backward over `layers`."""
    counts = Counts()
    with regions(counts, layers, module) as outputs, HostReads(counts), counts:
        out = forward()
        handles = tag_backward(counts, outputs, out)
        counts.phase, counts.region = "backward", "step"
        out.backward(torch.ones_like(out))
    for handle in handles:
        handle.remove()
    return summarize(name, counts, layers)


def count_llm(name: str, layers: int, seq: int = 256) -> dict:
    """The family's LLM (SMALL_TEXT's widths, `layers` deep) on one sequence of `seq` tokens with an
    image's rows (16 x 16 patches; DeepStack blocks where the family has them) and M-RoPE positions,
    forward to the per-token losses and backward, through models/vlm.llm_forward."""
    from dataclasses import replace

    from megatron_hetero.models.mrope import mrope_positions
    from megatron_hetero.models.vlm import build_llm, llm_forward

    family, sizes, vision = family_sizes(name, layers, small_text=True)
    sizes = replace(sizes, seq_length=seq)
    llm = build_llm(sizes, 1, groups(name, "llm"), torch.float32, whole=True)
    g = torch.Generator().manual_seed(0)
    start, grid, merge = 10, (1, 16, 16), vision["spatial_merge_size"]
    ids, labels = (torch.randint(0, SMALL_TEXT["vocab_size"], (1, seq), generator=g) for _ in range(2))
    positions = mrope_positions(seq, [start], [grid], merge)[:, None]  # [3, b, S]
    n = grid[1] * grid[2] // merge**2
    width = sizes.hidden_size * (1 + len(family.deepstack(sizes)))
    rows = torch.randn(n, width, generator=g).requires_grad_()
    at = torch.arange(start, start + n)  # rows of the [S * b, h] view, b = 1

    def forward():
        return llm_forward(llm, ids, positions, [(rows, at)], labels)
    forward().sum().backward()  # first call: lazy initializations out of the counts
    return counted(f"{name} LLM", llm.decoder.layers, forward)


def summarize(name: str, counts: Counts, layers) -> dict:
    """By phase and region: kernel-like operators (not views), of which copies / syncs; host reads."""
    table = collections.defaultdict(collections.Counter)
    names = collections.defaultdict(collections.Counter)
    for (phase, region, kind, op), n in counts.ops.items():
        table[(phase, region)][kind] += n
        if kind != "view":
            names[(phase, region)][op] += n
    rows = {}
    for (phase, region), kinds in sorted(table.items()):
        rows[f"{phase} {region}"] = {
            "kernels": sum(n for k, n in kinds.items() if k not in ("view", "host read")),
            **{k: kinds[k] for k in ("matmul", "copy", "elementwise", "sync", "host read", "view")},
            "ops": dict(names[(phase, region)].most_common()),
        }
    windowed = [i for i, layer in enumerate(layers) if getattr(layer.self_attention.core_attention, "windowed", False)]
    return {"family": name, "layers": len(layers), "windowed_layers": windowed, "regions": rows}


def print_table(result: dict) -> None:
    print(f"\n{result['family']} ({result['layers']} layers; windowed: {result['windowed_layers']})")
    print(f"{'region':22} {'kernels':>8} {'matmul':>7} {'copy':>6} {'elemw':>6} {'sync':>5} {'reads':>6} {'views':>6}")
    for region, row in result["regions"].items():
        print(f"{region:22} {row['kernels']:8} {row['matmul']:7} {row['copy']:6} {row['elementwise']:6} "
              f"{row['sync']:5} {row['host read']:6} {row['view']:6}")


def one_process(port: int) -> None:
    """This script as a one-process gloo job: the plugin's patches applied, Megatron's state initialized."""
    import megatron_hetero.patches
    from megatron_hetero.parallel.groups import init_distributed
    from megatron_hetero.parallel.parallel_state import init_outside_training

    os.environ.update({k: v for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                                         ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")) if k not in os.environ})
    megatron_hetero.patches.apply()
    init_distributed("gloo")
    init_outside_training(1234, tp_rank=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", default=["qwen2_5_vl_7b", "qwen3_vl_8b"],
                        help="family presets (families/<name>/presets.json)")
    parser.add_argument("--layers", type=int, default=4, help="vision layers")
    parser.add_argument("--llm", action="store_true", help="also count each family's LLM (count_llm)")
    parser.add_argument("--ops", action="store_true", help="also print each region's operators")
    parser.add_argument("--json", help="write the counts here")
    opts = parser.parse_args()

    one_process(29533)
    results = [count(name, opts.layers) for name in opts.family]
    results += [count_llm(name, opts.layers) for name in opts.family if opts.llm]
    for result in results:
        print_table(result)
        if opts.ops:
            for region, row in result["regions"].items():
                print(f"  {region}: {row['ops']}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
