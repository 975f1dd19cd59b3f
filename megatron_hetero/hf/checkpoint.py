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

from megatron_hetero.convert.files import export_hf, import_hf
from megatron_hetero.convert.progress import Progress, quiet, state_bytes
from megatron_hetero.convert.registry import FAMILIES
from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.spec.sizes import ModelSizes, sizes_from_dict, sizes_to_dict

MODEL_FILE = "model.json"


def untrained_file(name: str) -> str:
    """The file beside model.json holding module `name`'s Hugging Face tensors it does not hold."""
    return f"hf_untrained_{name}.safetensors"


def describe(sizes: ModelSizes, imported: dict) -> dict:
    """model.json: our sizes, and per module the Hugging Face family and config it came from, where
    its files keep our keys, its image processor's config, and the file of its untrained tensors."""
    return dict(sizes=sizes_to_dict(sizes),
                hf={name: dict(model_type=i.config.model_type, config=i.config.to_dict(), prefix=i.prefix,
                               processor=i.processor, untrained=untrained_file(name) if i.untrained else None)
                    for name, i in imported.items()})


def _start_world(layout) -> bool:
    """The default process group, where none is: torchrun's world for a layout, else one process on
    a store of its own, at a port the system picks (no other job's). True if started here."""
    from megatron_hetero.parallel.groups import init_distributed

    if dist.is_initialized():
        return False
    if layout is not None and "WORLD_SIZE" in os.environ:
        init_distributed()
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def _one_process_layout(sizes: ModelSizes) -> dict:
    """Every module whole on one process: vision and the LLM, and a family's other encoders (audio)."""
    from megatron_hetero.families import family_named

    encoders = [name for name in family_named(sizes.family).parts if name != "llm"] if sizes.family else ["vision"]
    return {"placement": "colocated", "edges": [f"{name} -> llm" for name in encoders],
            "modules": {**{name: {"role": "encoder"} for name in encoders}, "llm": {"role": "llm"}}}


@contextmanager
def model_under(sizes: ModelSizes, layout=None):
    """This rank's HeteroModel (its stage of every module it holds, weights from seed 0) under
    `layout`; None: a one-process world holding every module whole (tp = pp = 1). On CPUs
    megatron-core runs with megatron_hetero.patches applied (the command line applies them)."""
    from megatron_hetero.families.parts import build_vlm_parts
    from megatron_hetero.parallel.context import build_run
    from megatron_hetero.parallel.parallel_state import init_outside_training, point_at
    from megatron_hetero.runtime.model import HeteroModel
    from megatron_hetero.spec.layout import parse_layout

    started = _start_world(layout)
    try:
        layout = layout or parse_layout(_one_process_layout(sizes), 1)
        run = build_run(layout)
        point_at(run.primary.pgs)
        init_outside_training(0, tp_rank=run.primary.coords()["tp"])
        built = build_vlm_parts(run, sizes, seed=0)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        parts = {name: part.to(device) if device is not None else part for name, part in built.parts.items()}
        yield HeteroModel(run.with_parts(parts, {}), built.adapter)
    finally:
        if started:
            dist.destroy_process_group()


def one_process_model(sizes: ModelSizes):
    """A one-process world holding every module whole (tp = pp = 1): the HeteroModel, its run."""
    return model_under(sizes)


def import_checkpoint(vision_dir: str, llm_dir: str, save: str, projector: str | None = None,
                      progress: Progress | None = None) -> Path:
    """Write `save`/release (and the tracker, model.json and the untrained tensors beside it) from two
    Hugging Face directories."""
    from safetensors.torch import load_file, save_file

    progress = progress or quiet()
    vision = import_hf(vision_dir, progress=progress)
    if vision.family.module != "vision":
        raise HFMappingError(f"--vision {vision_dir} holds a {vision.family.name} model, not a vision tower")
    llm = import_hf(llm_dir, base=vision.sizes, progress=progress)
    if llm.family.module != "llm":
        raise HFMappingError(f"--llm {llm_dir} holds a {llm.family.name} model, not a language model")
    save_dir = Path(save)
    if (save_dir / "release").exists():
        raise HFMappingError(f"{save_dir / 'release'} exists; choose another --save directory")
    vision_state = dict(vision.state)
    if projector is not None:
        vision_state.update(load_file(projector))
    save_dir.mkdir(parents=True, exist_ok=True)
    imported = {"vision": vision, "llm": llm}
    (save_dir / MODEL_FILE).write_text(json.dumps(describe(llm.sizes, imported), indent=1))
    for name, i in imported.items():
        if i.untrained:
            save_file({k: t.contiguous() for k, t in i.untrained.items()}, save_dir / untrained_file(name))
    states = {"vision": vision_state, "llm": llm.state}
    missing = {"vision": vision.family.ours_only if projector is None else (), "llm": ()}
    write_release(save_dir, llm.sizes, states, missing, progress)
    return save_dir


def write_release(save_dir: Path, sizes: ModelSizes, states: dict, missing: dict, progress: Progress) -> None:
    """The release checkpoint of our modules' full state dicts (`missing`: prefixes each may lack),
    recording the model.json already beside it."""
    from megatron.core import dist_checkpointing

    from megatron_hetero.models.full_state import load_full_tensors
    from megatron_hetero.runtime.checkpoint import hetero_record, write_tracker

    with progress.stage("writing the checkpoint", state_bytes(states)), one_process_model(sizes) as model:
        for name, state in states.items():
            module = model.run.modules[name]
            load_full_tensors(module.part, state, module.pgs.tp, allow_missing=missing[name])
        record = {**hetero_record(model.run.layout, save_dir / MODEL_FILE), "optimizer_modules": []}
        state_dict = dict(model=model.sharded_state_dict(), iteration=0, checkpoint_version=3.0,
                          args=_checkpoint_args(sizes), hetero=record)
        staged, final = save_dir / ".staging" / "release", save_dir / "release"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        dist_checkpointing.save(state_dict, str(staged))
        os.replace(staged, final)
        write_tracker(save_dir, "release")


def _checkpoint_args(sizes: ModelSizes):
    """What Megatron's load checks of a checkpoint's arguments."""
    return types.SimpleNamespace(num_layers=sizes.num_layers, hidden_size=sizes.hidden_size,
                                 num_attention_heads=sizes.num_attention_heads, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1, consumed_train_samples=0)


def _checkpoint_path(load: str) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    from megatron_hetero.runtime.checkpoint import TRACKER

    tracker = Path(load) / TRACKER
    if not tracker.is_file():
        raise HFMappingError(f"--load {load} holds no checkpoint ({tracker.name} is missing)")
    text = tracker.read_text().strip()
    release = text == "release"
    return get_checkpoint_name(load, 0 if release else int(text), release, return_base_dir=True)


def read_description(load: str, model_file: str | None = None) -> tuple[dict, dict]:
    """The model description of a checkpoint (`model_file`, else the one its save recorded) and
    each module's untrained Hugging Face tensors (those the checkpoint carries, else the files beside
    `model_file`)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    from megatron_hetero.runtime.checkpoint import UNTRAINED, model_record, module_entries

    path = _checkpoint_path(load)
    record = load_common_state_dict(path).get("hetero") or {}
    if model_file is not None:
        record = {**model_record(model_file), **{k: v for k, v in record.items() if k == UNTRAINED and v}}
    description = record.get("model")
    if description is None:
        raise HFMappingError(f"checkpoint {path} records no Hugging Face model description; give the "
                             f"model.json of its import with --model-sizes")
    untrained = record.get(UNTRAINED) or {}
    for name, hf in module_entries(description).items():
        if hf.get("untrained") and name not in untrained:
            raise HFMappingError(f"checkpoint {path} lacks module {name}'s Hugging Face tensors it does not "
                                 f"train ({hf['untrained']}); give the model.json of its import with --model-sizes")
    return description, untrained


@contextmanager
def loaded_model(load: str, sizes: ModelSizes, layout=None):
    """The model (model_under: one process holding every module whole, or `layout`'s stages) holding
    the weights of checkpoint `load` (its tracker's iteration)."""
    from megatron.core import dist_checkpointing

    with model_under(sizes, layout) as model:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, _checkpoint_path(load))
        model.load_state_dict(loaded["model"])
        yield model


def full_states(model) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> its full (TP1/PP1) state dict, of a one-process model."""
    from megatron_hetero.models.full_state import full_tensors

    with torch.no_grad():
        return {name: full_tensors(m.part, m.pgs.tp) for name, m in model.run.modules.items()}


def read_states(load: str, sizes: ModelSizes, progress: Progress) -> dict[str, dict[str, torch.Tensor]]:
    """full_states of checkpoint `load`, its bytes counted on `progress` three times: read here,
    converted and written by the export."""
    with progress.stage("reading the checkpoint"), loaded_model(load, sizes) as model:
        states = full_states(model)
    nbytes = state_bytes(states)
    progress.done(nbytes)
    progress.expect(2 * nbytes)
    return states


def export_checkpoint(load: str, outs: dict[str, str], model_file: str | None = None,
                      progress: Progress | None = None) -> None:
    """Hugging Face directories (module name -> directory) of the weights in checkpoint `load`."""
    from transformers import AutoConfig

    progress = progress or quiet()
    description, untrained = read_description(load, model_file)
    if "family" in description:
        raise HFMappingError(f"--load {load} holds a whole {description['family']} model: export it with --out DIR")
    sizes = sizes_from_dict(description["sizes"])
    states = read_states(load, sizes, progress)
    for name, out in outs.items():
        hf = description["hf"][name]
        config = {k: v for k, v in hf["config"].items() if k != "model_type"}
        dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
        # in the dtype the imported files had
        state = {k: t.to(dtype) for k, t in progress.tensors(states[name].items())}
        with progress.stage(f"writing {out}", state_bytes(states[name]), expected=True):
            export_hf(out, FAMILIES[hf["model_type"]], sizes, state, AutoConfig.for_model(hf["model_type"], **config),
                      untrained.get(name), hf.get("prefix", ""), hf.get("processor"))
