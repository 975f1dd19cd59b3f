"""Write a tiny, randomly initialized Qwen2.5-VL model directory and a few conversation samples, to try
the Hugging Face path (import -> compare -> train -> export) on a CPU in a minute:

    python tools/make_tiny_vlm.py --out out/tiny
    # out/tiny/hf: config.json, model.safetensors, tokenizer, chat template, image processor
    # out/tiny/data/conversations.json and its images (several sizes, two in one sample, one text-only)

The model is 2 LLM layers of width 64 and a 3-layer ViT of width 32: its outputs mean nothing, its
structure is Qwen2.5-VL's (windowed ViT, 2x2 merger, M-RoPE, GQA). Needs transformers (`pip install .[hf]`).
"""

import argparse
import sys
from pathlib import Path

# The tiny models are the tests' own (tests/vlm_fixtures.py): one definition for both.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vlm_fixtures import conversations, qwen2_5_vl_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (hf/ and data/ are written in it)")
    args = parser.parse_args(argv)
    model = qwen2_5_vl_dir(args.out / "hf")
    data = conversations(args.out / "data", bad=False)
    print(f"wrote {model} (a tiny random Qwen2.5-VL) and {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
