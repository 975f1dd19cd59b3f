"""Megatron's checkpoints (`--save`, `--save-interval`, `--load`, torch_dist format) for a heterogeneous
run (megatron.training 0.19 `checkpointing.save_checkpoint`, `load_checkpoint`, `generate_state_dict`).

What is stored is megatron-core's distributed checkpoint of every module (HeteroModel and
HeteroOptimizer build each module's part with its own groups: keys and global shapes do not depend
on the layout), Megatron's own entries (arguments, iteration, consumed samples: the data position,
LR scheduler, RNG state under the rank's primary module) and `hetero`: the layout that wrote it
(printed on load, never required) and which modules had optimizer state. Loading under another
layout, world size or placement reshards; the RNG state is restored only under the same layout.

A save is visible only when complete: every rank writes into `<save>/.staging/iter_N`; after all
ranks have finished, rank 0 syncs the files, renames the directory to `<save>/iter_N` and then
replaces the tracker `latest_checkpointed_iteration.txt` (written to a temporary file, synced,
renamed). A rank killed mid-save leaves the previous checkpoint and tracker as they were.

Before anything is read into the model, every rank checks what it will load against the checkpoint's
metadata (each tensor present, its global shape, its shard file present and long enough); any
problem stops every rank with one line naming the checkpoint, the module and what is wrong.
"""

import copy
import os
import queue
import shutil
from pathlib import Path

import torch.distributed as dist
from megatron.training import get_args, print_rank_0

from megatron_hetero.patches._patch import replace
from megatron_hetero.runtime.checkpoint import (
    TRACKER,
    CheckpointError,
    fsync_dir,
    hetero_record,
    inspect_checkpoint,
    write_tracker,
)
from megatron_hetero.training.layout_args import fail

STAGING = ".staging"


def _group_kwargs(run) -> dict:
    """Megatron's checkpoint functions take the groups that name this rank's RNG state and replica:
    those of its primary module, its RNG state keyed under that module's name."""
    pgs = run.primary.pgs
    return dict(tp_group=pgs.tp, pp_group=pgs.pp, dp_cp_group=pgs.dp_cp, dp_group=pgs.dp,
                expt_dp_group=getattr(pgs, "expt_dp", None) or pgs.dp, rng_state_key_prefix=f"{run.primary.name}.")


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def publish(save_dir: Path, iteration: int) -> None:
    """Rank 0, after every rank wrote `<save>/.staging/iter_N`: make it `<save>/iter_N` and the
    tracker's iteration."""
    name = f"iter_{iteration:07d}"
    staged, final = save_dir / STAGING / name, save_dir / name
    _fsync_tree(staged)
    if final.exists():  # saved again at the same iteration: the complete new one replaces it
        old = save_dir / STAGING / f"{name}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old)
    else:
        os.replace(staged, final)
    fsync_dir(save_dir)
    write_tracker(save_dir, iteration)
    (save_dir / STAGING / TRACKER).unlink(missing_ok=True)  # Megatron's, written into the staging root


def _save_checkpoint(original):
    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        checkpointing_context=None, *args, **kwargs):
        megatron_args = get_args()
        run = megatron_args.hetero_run
        if run is None:
            return original(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                            checkpointing_context, *args, **kwargs)
        save_dir = Path(megatron_args.save)
        if dist.get_rank() == 0:  # what a save killed at this iteration left behind
            shutil.rmtree(save_dir / STAGING / f"iter_{iteration:07d}", ignore_errors=True)
        dist.barrier()
        megatron_args.save = str(save_dir / STAGING)
        try:
            original(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                     checkpointing_context, *args, **{**kwargs, **_group_kwargs(run)})
        finally:
            megatron_args.save = str(save_dir)
        if dist.get_rank() == 0:
            publish(save_dir, iteration)
        print_rank_0(f"  checkpoint of iteration {iteration} complete: {save_dir / f'iter_{iteration:07d}'}")
        dist.barrier()
    return save_checkpoint


def _generate_state_dict(original):
    def generate_state_dict(args, *rest, **kwargs):
        state_dict = original(args, *rest, **kwargs)
        if getattr(args, "hetero_run", None) is not None:
            # The run's live objects (groups, modules) are not arguments to store.
            saved = copy.copy(args)
            saved.hetero_run = saved.hetero_layout_spec = None
            state_dict["args"] = saved
            state_dict["hetero"] = hetero_record(args.hetero_layout_spec, getattr(args, "model_sizes", None))
        return state_dict
    return generate_state_dict


def _load_checkpoint(original):
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, *args, **kwargs):
        megatron_args = get_args()
        run = megatron_args.hetero_run
        load_dir = getattr(megatron_args, load_arg)
        if run is None or load_dir is None:
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *args, **kwargs)
        try:
            found = inspect_checkpoint(Path(load_dir), ddp_model[0], optimizer,
                                       load_optimizer=not (megatron_args.no_load_optim or megatron_args.finetune))
        except CheckpointError as error:
            fail(str(error))
        if found is None:  # no checkpoint: Megatron's own behaviour (start anew, or exit on request)
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *args, **kwargs)
        print_rank_0(f" checkpoint {found.path} was written under layout:\n{found.rank_map}")
        no_load_rng = megatron_args.no_load_rng
        if not found.same_layout:
            print_rank_0(" layout changed since the save: the RNG state is not restored")
            megatron_args.no_load_rng = True
        if optimizer is not None:
            optimizer.fresh = set(found.fresh_modules)
            for name in found.fresh_modules:
                print_rank_0(f" module {name} had no optimizer state in the checkpoint (frozen then): its optimizer "
                             f"starts anew")
        try:
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict,
                            *args, **{**kwargs, **_group_kwargs(run)})
        except (AssertionError, KeyError, RuntimeError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            fail(f"checkpoint {found.path}: {first}")
        finally:
            megatron_args.no_load_rng = no_load_rng
            if optimizer is not None:
                optimizer.fresh = set()
    return load_checkpoint


def _results_queue(original):
    local = queue.Queue()

    def get_write_results_queue(mp_mode: str = "spawn"):
        """A synchronous save writes from threads of this process, so a thread queue carries the
        results; upstream starts a multiprocessing Manager process per rank for it, a whole new
        interpreter (tens of CPU seconds per save run on a small CPU machine). Asynchronous saves
        (refused with --hetero-layout) keep upstream's."""
        from megatron.training import global_vars

        args = global_vars._GLOBAL_ARGS
        return original(mp_mode) if args is None or args.async_save else local
    return get_write_results_queue


def apply() -> None:
    replace("megatron.training.training.save_checkpoint", _save_checkpoint,
            params=("iteration", "model", "optimizer", "opt_param_scheduler", "checkpointing_context",
                    "tp_group", "pp_group", "dp_cp_group", "dp_group", "expt_dp_group", "rng_state_key_prefix"))
    replace("megatron.training.training.load_checkpoint", _load_checkpoint,
            params=("ddp_model", "optimizer", "opt_param_scheduler", "load_arg", "strict",
                    "tp_group", "pp_group", "dp_cp_group", "dp_group", "expt_dp_group", "rng_state_key_prefix"))
    replace("megatron.training.checkpointing.generate_state_dict", _generate_state_dict, params=("args",))
    replace("megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue", _results_queue,
            params=("mp_mode",))
