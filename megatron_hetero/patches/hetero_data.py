"""Global microbatches for every rank (megatron.training 0.19 `build_pretraining_data_loader`).

Modules split a microbatch differently (the LLM over its data-parallel ranks, each encoder over its
own), so under `--hetero-layout` every rank's loader yields the global microbatch i: the samples
microbatch i of every LLM data-parallel rank takes, in rank order (micro batch size x LLM dp samples,
the same samples and order upstream's sampler gives those ranks). Each module takes its share.

A dataset with a `collate` (data/conversations.py) batches its samples itself (items ragged over
samples) and reports the bad samples it passed over: counted in its `report` with a warning, or with
--strict-data the run stops with one line naming the file and sample (every rank reads the same
global microbatch, so every rank stops at the same one).
"""

import contextlib

from megatron.training import get_args, print_rank_0

from megatron_hetero.data.bad_data import DataError, one_line
from megatron_hetero.patches._patch import PASS_THROUGH, replace, temporarily
from megatron_hetero.training.layout_args import fail


@contextlib.contextmanager
def _one_data_parallel_rank(args, llm_dp: int):
    """Upstream's loader built as for one data-parallel rank reading LLM-dp times the micro batch."""
    sizes = (args.micro_batch_size, getattr(args, "eval_micro_batch_size", None))
    args.micro_batch_size *= llm_dp
    if sizes[1] is not None:
        args.eval_micro_batch_size *= llm_dp
    state = "megatron.core.parallel_state"
    try:
        with temporarily(f"{state}.get_data_parallel_rank", lambda rank: lambda *a, **k: 0, PASS_THROUGH), \
                temporarily(f"{state}.get_data_parallel_world_size", lambda size: lambda *a, **k: 1, PASS_THROUGH):
            yield
    finally:
        args.micro_batch_size, eval_micro_batch_size = sizes
        if eval_micro_batch_size is not None:
            args.eval_micro_batch_size = eval_micro_batch_size


class _ReportingLoader:
    """The loader's batches without their `skipped` entry, which goes to the dataset's report."""

    def __init__(self, loader, report, strict: bool):
        self.loader, self.report, self.strict = loader, report, strict

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        try:
            for batch in self.loader:
                skipped = batch.pop("skipped")
                if skipped and self.strict:
                    fail(f"--strict-data: {skipped[0].line()}")
                self.report.record(skipped)
                for bad in skipped:
                    print_rank_0(f"warning: skipped {bad.line()}; {self.report.counts[bad.reason]} {bad.reason} "
                                 f"so far (--strict-data stops instead)")
                yield batch
        except DataError as error:  # every rank reads the same batch, so every rank stops here
            fail(one_line(error))


def _build_loader(original):
    def build_pretraining_data_loader(dataset, consumed_samples):
        args = get_args()
        if args.hetero_run is None:
            return original(dataset, consumed_samples)
        with _one_data_parallel_rank(args, args.hetero_run.layout.llm.dp):
            loader = original(dataset, consumed_samples)
        if loader is None or not hasattr(dataset, "collate"):
            return loader
        loader.collate_fn = dataset.collate  # read when iteration starts, by the workers too
        return _ReportingLoader(loader, dataset.report, args.strict_data)
    return build_pretraining_data_loader


def apply() -> None:
    replace("megatron.training.training.build_pretraining_data_loader", _build_loader,
            params=("dataset", "consumed_samples"))
