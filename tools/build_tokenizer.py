"""Build the shipped caption tokenizer, megatron_hetero/data/shapes_caption.model.

A sentencepiece "word" model trained on every caption the shapes dataset can produce, so each
caption word is exactly one token. Ids: pad=0, unk=1, bos=2, eos=3, <image>=4, then the words.
Regenerating gives a byte-identical file:

    python tools/build_tokenizer.py [--output PATH]
"""

import argparse
import io
from pathlib import Path

import sentencepiece as spm

from megatron_hetero.data.shapes import all_captions

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "megatron_hetero" / "data" / "shapes_caption.model"
IMAGE_TOKEN = "<image>"
SPECIAL_PIECES = 5  # pad, unk, bos, eos, <image>


def build_model_bytes() -> bytes:
    captions = all_captions()
    words = sorted({word for caption in captions for word in caption.split()})
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions),
        model_writer=model,
        model_type="word",
        vocab_size=len(words) + SPECIAL_PIECES,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        # A control symbol, not a user-defined one: the word model would learn a stray "▁<image>"
        # word piece for a user-defined symbol, and text should never be able to forge image slots.
        control_symbols=[IMAGE_TOKEN],
        # identity skips the NFKC table, which would be most of the file; captions are plain ASCII.
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    data = build_model_bytes()
    args.output.write_bytes(data)
    print(f"wrote {args.output} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
