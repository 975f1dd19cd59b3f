"""Hugging Face directories <-> Megatron checkpoints of our modules (`python -m megatron_hetero.hf`).

`import_checkpoint` builds a vision encoder and an LLM from Hugging Face directories (one process,
every module whole), puts the weights in, and writes a Megatron distributed checkpoint (torch_dist,
tracker "release": Megatron loads its weights and starts at iteration 0 with a new optimizer) plus
`model.json`, the model description the training script builds the same model from (`--model-sizes`).
Its tensors carry the same layout-independent keys as a training checkpoint, so any layout loads it.
`export_checkpoint` reads the weights of any checkpoint of such a model (imported, or saved by a
training run under any layout) and writes one Hugging Face directory per module.
"""

import json
import os
import shutil
import types
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hetero.hf.files import export_hf, import_hf
from megatron_hetero.hf.registry import FAMILIES
from megatron_hetero.hf.rules import HFMappingError
from megatron_hetero.models.sizes import ModelSizes, sizes_from_dict, sizes_to_dict

MODEL_FILE = "model.json"
MODULES = ("vision", "llm")


def describe(sizes: ModelSizes, imported: dict) -> dict:
    """model.json: our sizes, and per module the Hugging Face family and config it came from."""
    return dict(sizes=sizes_to_dict(sizes),
                hf={name: dict(model_type=i.config.model_type, config=i.config.to_dict()) for name, i in imported.items()})


def _start_world(layout) -> bool:
    """The default process group, where none is: torchrun's world for a layout, else one process.
    True if started here."""
    from megatron_hetero.groups import init_distributed

    if dist.is_initialized():
        return False
    if layout is not None and "WORLD_SIZE" in os.environ:
        init_distributed()
    else:  # an in-memory store: no port to take (another tool's may be in use)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


@contextmanager
def model_under(sizes: ModelSizes, layout=None):
    """This rank's HeteroModel (its stage of every module it holds, weights from seed 0) under
    `layout`; None: a one-process world holding every module whole (tp = pp = 1)."""
    from megatron_hetero.layout import parse_layout
    from megatron_hetero.models.vlm_parts import build_vlm_parts
    from megatron_hetero.patches import cpu
    from megatron_hetero.patches.parallel_state import init_outside_training, point_at
    from megatron_hetero.runtime.context import build_run
    from megatron_hetero.runtime.model import HeteroModel

    started = _start_world(layout)
    try:
        cpu.apply()
        layout = layout or parse_layout({"placement": "colocated", "edges": ["vision -> llm"],
                                         "modules": {"vision": {"role": "encoder"}, "llm": {"role": "llm"}}}, 1)
        run = build_run(layout)
        point_at(run.primary.pgs)
        init_outside_training(0, tp_rank=run.primary.coords()["tp"])
        built = build_vlm_parts(run, sizes, seed=0)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        for name, part in built.parts.items():
            run.modules[name].part = part.to(device) if device is not None else part
        yield HeteroModel(run, built.adapter)
    finally:
        if started:
            dist.destroy_process_group()


def one_process_model(sizes: ModelSizes):
    """A one-process world holding every module whole (tp = pp = 1): the HeteroModel, its run."""
    return model_under(sizes)


def _record(model, description: dict) -> dict:
    from megatron_hetero.patches.checkpointing import hetero_record

    return {**hetero_record(model.run.layout), "optimizer_modules": [], "model": description}


def _write_release(model, sizes: ModelSizes, description: dict, save: str) -> Path:
    """Write the model's weights as `save`/release (a staged save, then the tracker) and model.json."""
    from megatron.core import dist_checkpointing

    from megatron_hetero.patches.checkpointing import write_tracker

    save_dir = Path(save)
    staged, final = save_dir / ".staging" / "release", save_dir / "release"
    if final.exists():
        raise HFMappingError(f"{final} exists; choose another --save directory")
    state_dict = dict(model=model.sharded_state_dict(), iteration=0, checkpoint_version=3.0,
                      args=_checkpoint_args(sizes), hetero=_record(model, description))
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    dist_checkpointing.save(state_dict, str(staged))
    os.replace(staged, final)
    write_tracker(save_dir, "release")
    (save_dir / MODEL_FILE).write_text(json.dumps(description, indent=1))
    return save_dir


def import_checkpoint(vision_dir: str, llm_dir: str, save: str, projector: str | None = None) -> Path:
    """Write `save`/release (and the tracker, and model.json) from two Hugging Face directories."""
    from safetensors.torch import load_file

    from megatron_hetero.training.full_state import load_full_tensors

    vision = import_hf(vision_dir)
    if vision.family.module != "vision":
        raise HFMappingError(f"--vision {vision_dir} holds a {vision.family.name} model, not a vision tower")
    llm = import_hf(llm_dir, base=vision.sizes)
    if llm.family.module != "llm":
        raise HFMappingError(f"--llm {llm_dir} holds a {llm.family.name} model, not a language model")
    sizes = llm.sizes
    vision_state = dict(vision.state)
    if projector is not None:
        vision_state.update({name: t for name, t in load_file(projector).items()})
    description = describe(sizes, {"vision": vision, "llm": llm})
    with one_process_model(sizes) as model:
        for name, imported, state in (("vision", vision, vision_state), ("llm", llm, llm.state)):
            module = model.run.modules[name]
            missing = imported.family.ours_only if projector is None else ()
            load_full_tensors(module.part, state, module.pgs.tp, allow_missing=missing)
        return _write_release(model, sizes, description, save)


def _checkpoint_args(sizes: ModelSizes):
    """What Megatron's load checks of a checkpoint's arguments."""
    return types.SimpleNamespace(num_layers=sizes.num_layers, hidden_size=sizes.hidden_size,
                                 num_attention_heads=sizes.num_attention_heads, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1, consumed_train_samples=0)


def read_description(load: str, model_file: str | None = None) -> dict:
    """The model description of a checkpoint: `model_file`, else the one its save recorded."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.training.checkpointing import get_checkpoint_name

    if model_file is not None:
        return json.loads(Path(model_file).read_text())
    tracker = Path(load) / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        raise HFMappingError(f"--load {load} holds no checkpoint ({tracker.name} is missing)")
    text = tracker.read_text().strip()
    release = text == "release"
    path = get_checkpoint_name(load, 0 if release else int(text), release, return_base_dir=True)
    description = (load_common_state_dict(path).get("hetero") or {}).get("model")
    if description is None:
        raise HFMappingError(f"checkpoint {path} records no Hugging Face model description; give the "
                             f"model.json of its import with --model-sizes")
    return description


@contextmanager
def loaded_model(load: str, sizes: ModelSizes, layout=None):
    """The model (model_under: one process holding every module whole, or `layout`'s stages) holding
    the weights of checkpoint `load` (its tracker's iteration)."""
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import get_checkpoint_name

    text = (Path(load) / "latest_checkpointed_iteration.txt").read_text().strip()
    path = get_checkpoint_name(load, 0 if text == "release" else int(text), text == "release", return_base_dir=True)
    with model_under(sizes, layout) as model:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(loaded["model"])
        yield model


def full_states(model) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> its full (TP1/PP1) state dict, of a one-process model."""
    from megatron_hetero.training.full_state import full_tensors

    with torch.no_grad():
        return {name: full_tensors(m.part, m.pgs.tp) for name, m in model.run.modules.items()}


def export_checkpoint(load: str, outs: dict[str, str], model_file: str | None = None) -> None:
    """Hugging Face directories (module name -> directory) of the weights in checkpoint `load`."""
    from transformers import AutoConfig

    description = read_description(load, model_file)
    if "family" in description:
        raise HFMappingError(f"--load {load} holds a whole {description['family']} model: export it with --out DIR")
    sizes = sizes_from_dict(description["sizes"])
    with loaded_model(load, sizes) as model:
        states = full_states(model)
    for name, out in outs.items():
        hf = description["hf"][name]
        family = FAMILIES[hf["model_type"]]
        config = {k: v for k, v in hf["config"].items() if k != "model_type"}
        dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
        state = {k: t.to(dtype) for k, t in states[name].items()}  # in the dtype the imported files had
        export_hf(out, family, sizes, state, AutoConfig.for_model(hf["model_type"], **config))
