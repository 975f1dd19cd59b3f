"""Write a small LLaVA-style conversation dataset (PNG files + JSON) from the shapes generator.

    python tools/make_dataset.py --out out/shapes_data --num-samples 8192
    torchrun ... examples/pretrain_vlm.py ... --data-path out/shapes_data/conversations.json

Variable images per sample with --max-images, text-only samples with --text-only (a fraction).
With --energon the same samples also as a megatron-energon dataset (out/energon, prepared with
`energon prepare`), which --data-path takes as well.
"""

import argparse
import time

from megatron_hetero.data.make_dataset import ENERGON_DIR, write_conversations, write_energon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (images/ and conversations.json)")
    parser.add_argument("--num-samples", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--split", choices=("train", "heldout"), default="train")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--max-images", type=int, default=1, help="images per sample: 1 to this many")
    parser.add_argument("--text-only", type=float, default=0.0, help="fraction of samples without an image")
    parser.add_argument("--jsonl", action="store_true", help="one sample a line (conversations.jsonl)")
    parser.add_argument("--energon", action="store_true",
                        help=f"also write the samples as a megatron-energon dataset ({ENERGON_DIR}/ in --out)")
    args = parser.parse_args()
    if args.num_samples < 1 or args.max_images < 1 or not 0 <= args.text_only <= 1:
        parser.error("--num-samples and --max-images must be at least 1, --text-only within [0, 1]")
    start = time.perf_counter()
    path = write_conversations(args.out, args.num_samples, args.seed, args.split, args.image_size,
                               args.max_images, args.text_only, args.jsonl)
    if args.energon:
        print(f"energon dataset: {write_energon(path, f'{args.out}/{ENERGON_DIR}')}")
    print(f"wrote {args.num_samples} samples to {path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
