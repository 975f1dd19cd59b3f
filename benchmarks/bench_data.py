"""The conversation loader's samples/s per rank against what training consumes, at a workload's shapes.

    python benchmarks/bench_data.py --workload W1 [--samples 16] [--workers 0 2] [--out FILE.jsonl]

Writes a dataset of the workload's shapes (tools/make_dataset.py's generator: images per sample,
images at the next multiple of 8 pixels, resized to the workload's size by the loader), then reads
global batches through torch's DataLoader as a rank does (data/conversations.py: every rank tokenizes
every sample; a rank holding a vision encoder's first stage decodes its DP share of the images,
others none). Training consumes a global batch per step: the workload's fastest recorded step
(docs/runs/bench_e2e/results.jsonl), so a rank's loader keeps up when it reads at least
global batch / step time samples/s. The wall rates depend on how loaded the CPU is; the CPU seconds
per sample (without workers) do not: times the consumption, they are the cores a rank's DataLoader
workers need to keep up.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_hetero.data.chat import CaptionChatTokenizer
from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec
from megatron_hetero.data.images import ImageSpec
from megatron_hetero.data.make_dataset import write_conversations
from megatron_hetero.data.media import TileImages
from megatron_hetero.planner.presets import BENCH_WORKLOADS

RESULTS = Path(__file__).parent.parent / "docs" / "runs" / "bench_e2e" / "results.jsonl"


def consumed_per_s(workload: str) -> tuple[float, dict]:
    """Samples/s training consumes: the workload's fastest recorded step, and that record."""
    records = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    best = min((r for r in records if r["workload"] == workload), key=lambda r: r["step_s"])
    return BENCH_WORKLOADS[workload].global_batch / best["step_s"], best


def loader_per_s(dataset: ConversationSamples, global_batch: int, workers: int, batches: int) -> tuple[float, float]:
    """(samples/s, CPU seconds per sample of this process) through a DataLoader of global batches,
    after one warm-up batch (workers started). With workers, the CPU time is theirs, not counted."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch, num_workers=workers,
                                         collate_fn=dataset.collate, persistent_workers=workers > 0)
    it = iter(loader)
    next(it)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(it)
    samples = batches * global_batch
    return samples / (time.perf_counter() - start), (time.process_time() - cpu) / samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(BENCH_WORKLOADS), default="W1")
    parser.add_argument("--samples", type=int, default=16, help="distinct samples written (read in a loop)")
    parser.add_argument("--batches", type=int, default=4, help="global batches timed per configuration")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--encoder-dp", type=int, default=2, help="the vision encoder's DP size (its share)")
    parser.add_argument("--out", help="append one JSON line per configuration")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in DataLoader workers and under torchrun (OMP_NUM_THREADS=1)
    w = BENCH_WORKLOADS[args.workload]
    need, record = consumed_per_s(args.workload)
    print(f"{args.workload}: training consumes {need:.2f} samples/s (global batch {w.global_batch} per "
          f"{record['step_s']:.3f} s step, {record['layout']} on {record['gpus']} GPUs, {record['llm_layers']} "
          f"LLM layers); {w.images_per_sample} images of {w.image_size} px, {w.seq_length} tokens per sample")
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        path = write_conversations(directory, args.samples, image_size=-(-w.image_size // 8) * 8,
                                   min_images=w.images_per_sample, max_images=w.images_per_sample)
        print(f"wrote {args.samples} samples in {time.perf_counter() - start:.1f} s")
        roles = {f"decodes 1/{args.encoder_dp} of the images": ((args.encoder_dp, 0),), "decodes none": ()}
        for role, shares in roles.items():
            spec = ConversationSpec(str(path), directory, w.seq_length,
                                    TileImages(ImageSpec(w.image_size), w.tokens_per_image, w.tokens_per_image),
                                    decode_shares=shares)
            dataset = ConversationSamples(spec, CaptionChatTokenizer(), args.samples * 1000)
            for workers in args.workers:
                rate, cpu = loader_per_s(dataset, w.global_batch, workers, args.batches)
                line = dict(workload=args.workload, role=role, workers=workers, samples_per_s=rate,
                            consumed_per_s=need, step_s=record["step_s"], layout=record["layout"])
                text = f"  rank that {role}, {workers} workers: {rate:.2f} samples/s = {rate / need:.1f}x what " \
                       f"training consumes"
                if not workers:  # the load-independent figure: cores a rank's loader needs at that rate
                    line.update(cpu_s_per_sample=cpu, cores_needed=cpu * need)
                    text += f"; {cpu:.3f} CPU s per sample: {cpu * need:.2f} cores keep up"
                print(text)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
