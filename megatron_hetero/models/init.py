"""Layout-independent weights for pipeline stages.

Modules are initialized full-size from a per-module seed (use_cpu_initialization), so every TP size
starts from the same model. A pipeline stage builds only some layers, and an expert-parallel rank
only its experts, which shifts the random stream:
`build_stage` instead builds the whole (pp=1, ep=1) module from the same seed on this rank's TP slice
and copies the stage's part out of it. The whole module is built from the same pg_collection with a
config whose pipeline size is 1 (megatron-core then builds every layer at offset 0 whatever
`pg_collection.pp` says) and an expert-parallel group of this rank alone (groups.ModuleGroups), so
no extra process group is needed and TP ranks keep their own slice.

On a GPU the full-size tensors are drawn there (`DeviceDrawn`): megatron-core's CPU initialization
draws, casts and slices every full weight on the host, single-threaded (11 ns per weight on an H200
machine's host: about 100 s per rank for Qwen2.5-Omni-7B's 8.9 billion).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

M = TypeVar("M", bound=torch.nn.Module)


@dataclass(frozen=True)
class DeviceDrawn:
    """An init method whose full-size master weights megatron-core's CPU initialization
    (`_initialize_affine_weight_cpu`) builds on `device` (patches/device_init.py): each weight from its
    own seed, one draw of the default CPU generator, so the weights stay layout-independent (every TP
    rank draws the same full tensor and keeps its slice) and follow the run's seed. Called directly, or
    without the patch, it is `init`."""

    init: Callable[[torch.Tensor], object]
    device: torch.device

    def __call__(self, tensor: torch.Tensor):
        return self.init(tensor)


def on_device(init: Callable) -> Callable:
    """`init` as a DeviceDrawn on this process's GPU; `init` itself where there is none (the CPU's
    draws are then upstream's, bit for bit)."""
    if not torch.cuda.is_available():
        return init
    return DeviceDrawn(init, torch.device("cuda", torch.cuda.current_device()))


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def whole_names(stage: torch.nn.Module) -> dict[str, str]:
    """Each parameter and buffer name of `stage` -> its name in the whole (pp=1, ep=1) module. A
    stage's local layer i is global layer `layer_number` (1-based): on the second of two 2-layer
    stages, decoder.layers.0.* -> decoder.layers.2.*; an MoE layer's local expert j is global expert
    `local_expert_indices[j]` (experts.local_experts.j.* -> experts.local_experts.4.* on the second
    of two EP ranks of 8 experts); names outside layers stay, but for the copy of a tied input
    embedding that megatron-core keeps as the output layer of a later stage (the whole module has
    the embedding alone)."""
    layers = {name + ".": f"{name.rsplit('.', 1)[0]}.{module.layer_number - 1}."
              for name, module in stage.named_modules() if isinstance(module, BaseTransformerLayer)}
    prefixes = dict(layers)
    for name, module in stage.named_modules():
        for j, index in enumerate(getattr(module, "local_expert_indices", ())):
            local = f"{name}.experts.local_experts."
            layer = next(p for p in layers if local.startswith(p))
            prefixes[f"{local}{j}."] = f"{layers[layer]}{local[len(layer):]}{index}."
    if getattr(stage, "share_embeddings_and_output_weights", False) and not stage.pre_process:
        prefixes["output_layer."] = "embedding.word_embeddings."

    def rename(name: str) -> str:
        prefix = max((p for p in prefixes if name.startswith(p)), key=len, default=None)
        return name if prefix is None else prefixes[prefix] + name[len(prefix):]

    return {name: rename(name) for name in _tensors(stage)}


@torch.no_grad()
def copy_from_whole(stage: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Set every parameter and buffer of `stage` to its counterpart in `whole` (the same module
    built with pp=1 on the same TP slice)."""
    source, names = _tensors(whole), whole_names(stage)
    for name, tensor in _tensors(stage).items():
        tensor.copy_(source[names[name]])


def build_stage(build: Callable[[bool], M], seed: int, pp: int, layout_independent: bool = True,
                ep: int = 1) -> M:
    """This rank's pipeline stage of a module, its weights drawn from `seed`.

    build(whole) builds the module: this rank's stage for whole=False, the pp=1 (and ep=1: every
    expert) module for whole=True (e.g. `lambda whole: build_llm(sizes, tp, pgs, whole=whole)`). With
    `layout_independent` and pp > 1 or ep > 1 the stage's weights are those of the whole module built
    from `seed`, at the cost of building it once per rank (turn it off for large models: the stage is
    then initialized from `seed` directly, and differs from the whole module)."""
    torch.manual_seed(seed)
    stage = build(False)
    if layout_independent and (pp > 1 or ep > 1):
        torch.manual_seed(seed)
        copy_from_whole(stage, build(True))
    return stage
