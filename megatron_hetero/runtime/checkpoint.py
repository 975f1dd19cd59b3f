"""What a checkpoint holds (`hetero_record`), written durably (`write_tracker`), and checked before
anything is loaded (`inspect_checkpoint`); patches/checkpointing.py and hf/checkpoint.py use them.

`inspect_checkpoint` is collective over the world: every rank checks the tensors it will load
(present, same global shape) and every shard file of the checkpoint (present, long enough); all ranks
then agree on the first problem found, so a damaged checkpoint stops every rank with the same line
instead of some ranks failing inside the load while the others wait for them.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from megatron.core.dist_checkpointing import load_common_state_dict
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

TRACKER = "latest_checkpointed_iteration.txt"
UNTRAINED = "hf_untrained"  # a record's Hugging Face tensors the model does not hold, per module


def hetero_record(layout, model_file: str | None = None) -> dict:
    """What a checkpoint says about the run that wrote it; `model_file`: the model description the
    run was built from (`--model-sizes`, e.g. an import's model.json: an export needs it)."""
    record = dict(layout=repr(layout), rank_map=layout.rank_map(),
                  optimizer_modules=[m.name for m in (*layout.encoders, layout.llm) if not m.freeze])
    if model_file:
        record.update(model_record(model_file))
    return record


def module_entries(description: dict) -> dict:
    """A model description's Hugging Face entry per module (an import of one directory per module);
    a whole VLM's import (a family, hf/whole_model.py) describes its one directory instead: none."""
    return {} if "family" in description else description.get("hf", {})


def model_record(model_file: str | Path) -> dict:
    """A model description (model.json) and, under UNTRAINED, the Hugging Face tensors its modules do
    not hold (files beside it, named by the description: hf/checkpoint.py), which every checkpoint
    of a run built from it carries on, so that an export gives them back."""
    from safetensors.torch import load_file

    description = json.loads(Path(model_file).read_text())
    files = {name: hf["untrained"] for name, hf in module_entries(description).items() if hf.get("untrained")}
    untrained = {name: load_file(Path(model_file).parent / file) for name, file in files.items()}
    return {"model": description, UNTRAINED: untrained}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(save_dir: Path, iteration: int | str) -> None:
    """The tracker names `iteration` ("release" for an import), atomically and durably."""
    tmp = save_dir / f".{TRACKER}.tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / TRACKER)
    fsync_dir(save_dir)


class CheckpointError(ValueError):
    """A checkpoint this run cannot load; one line naming it, the module and what is wrong."""


@dataclass
class Found:
    path: Path
    rank_map: str  # the layout that wrote it, as `layout check` prints it
    same_layout: bool
    fresh_modules: list[str]  # trained now, without optimizer state in the checkpoint


def _module_of(key: str, names) -> str:
    return next((part for part in key.split(".") if part in names), "?")


def _same_shape(stored: tuple, tensor: ShardedTensor) -> bool:
    """The stored global shape fits the model's; a padded vocabulary's rows may differ (the load reads
    the rows both have and zero-fills the others: models/vocab.py)."""
    want = tuple(tensor.global_shape)
    if tensor.allow_shape_mismatch:
        return stored[1:] == want[1:]
    return stored == want


def _tensor_problems(path: Path, model, metadata, names) -> list[str]:
    found = metadata.state_dict_metadata
    problems = []
    for tensor in nested_values(model.sharded_state_dict()):
        if not isinstance(tensor, ShardedTensor):
            continue
        module, stored = _module_of(tensor.key, names), found.get(tensor.key)
        if stored is None:
            problems.append(f"module {module}: tensor {tensor.key} is not in it (another model, or other module names)")
        elif isinstance(stored, TensorStorageMetadata) and not _same_shape(tuple(stored.size), tensor):
            problems.append(f"module {module}: tensor {tensor.key} has shape {tuple(stored.size)} there, "
                            f"{tuple(tensor.global_shape)} in this run's model (model sizes differ: use the "
                            f"sizes it was saved with)")
    return problems


def _file_problems(path: Path, metadata, names) -> list[str]:
    sizes, problems = {}, []
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            sizes[name] = os.path.getsize(path / name) if (path / name).is_file() else None
        if sizes[name] is None or sizes[name] < info.offset + info.length:
            end = info.offset + info.length
            what = "missing" if sizes[name] is None else f"truncated ({sizes[name]} of {end} bytes)"
            problems.append(f"module {_module_of(index.fqn, names)}: shard file {name} is {what}")
    return problems


def _local_problem(path: Path, model, names) -> tuple[str | None, dict | None]:
    try:
        common = load_common_state_dict(path)
        metadata = FileSystemReader(str(path)).read_metadata()
    except (Exception, CheckpointException) as error:  # any unreadable file (torch's error is a BaseException)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"cannot be read ({type(error).__name__}: {first})", None
    problems = _file_problems(path, metadata, names) + _tensor_problems(path, model, metadata, names)
    return (problems[0] if problems else None), common


def inspect_checkpoint(load_dir: Path, model, optimizer, load_optimizer: bool) -> Found | None:
    """The checkpoint `--load` names (its tracker's iteration), checked for this rank's model and
    agreed over the world; None where there is no tracker (nothing saved yet)."""
    from megatron.training.checkpointing import get_checkpoint_name, read_metadata

    if not (load_dir / TRACKER).is_file():
        return None
    iteration, release = read_metadata(str(load_dir / TRACKER))
    path = Path(get_checkpoint_name(str(load_dir), iteration, release, return_base_dir=True))
    run = model.run
    problem, common = _local_problem(path, model, set(run.modules))
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(f"checkpoint {path}: {first}")
    record = common.get("hetero") or {}
    saved_args = common.get("args")
    fresh = []
    if load_optimizer and optimizer is not None and not release:
        saved_distributed = getattr(saved_args, "use_distributed_optimizer", False)
        if saved_distributed < optimizer.config.use_distributed_optimizer:
            raise CheckpointError(f"checkpoint {path}: saved without --use-distributed-optimizer, whose state "
                                  f"lacks the distributed optimizer's main weights; drop the flag, or add "
                                  f"--no-load-optim to start the optimizer anew")
        if saved_distributed > optimizer.config.use_distributed_optimizer and optimizer.config.bf16:
            raise CheckpointError(f"checkpoint {path}: saved with --use-distributed-optimizer, whose state "
                                  f"loads into megatron-core's fp32 optimizer but not its bf16 one; keep the "
                                  f"flag, or add --no-load-optim to start the optimizer anew")
        stateful = record.get("optimizer_modules", [])
        fresh = [m.name for m in run.modules.values() if not m.layout.freeze and m.name not in stateful]
    return Found(path, record.get("rank_map", "(not recorded)"), record.get("layout") == repr(run.layout), fresh)
