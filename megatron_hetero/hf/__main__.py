"""Hugging Face weights in and out of Megatron checkpoints of our modules:

    python -m megatron_hetero.hf import --vision HF_DIR --llm HF_DIR --save CKPT [--projector FILE]
    python -m megatron_hetero.hf export --load CKPT --vision-out DIR --llm-out DIR [--model-sizes FILE]

Train from an import with examples/pretrain_vlm.py ... --load CKPT --model-sizes CKPT/model.json
(any layout). Mistakes are one `error:` line and exit code 2.
"""

import argparse
import sys

from megatron_hetero.hf.rules import HFMappingError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_hetero.hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face directories -> a Megatron checkpoint")
    imp.add_argument("--vision", required=True, help="a SigLIP or CLIP (vision) model directory")
    imp.add_argument("--llm", required=True, help="a Llama or Qwen2 model directory")
    imp.add_argument("--save", required=True, help="the checkpoint directory to write")
    imp.add_argument("--projector", help="a safetensors file of the projector's weights (our names, "
                                         "projector.*); without it the projector is newly initialized")
    exp = commands.add_parser("export", help="a Megatron checkpoint -> Hugging Face directories")
    exp.add_argument("--load", required=True, help="a checkpoint directory (its tracker's iteration)")
    exp.add_argument("--vision-out")
    exp.add_argument("--llm-out")
    exp.add_argument("--model-sizes", help="the model.json of the import (default: the one the checkpoint records)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import megatron_hetero.patches

    megatron_hetero.patches.apply()  # megatron-core on CPUs; this command line is an entry point
    from megatron_hetero.hf.checkpoint import export_checkpoint, import_checkpoint

    try:
        if args.command == "import":
            path = import_checkpoint(args.vision, args.llm, args.save, args.projector)
            print(f"wrote {path}/release; train from it with: --load {path} --model-sizes {path}/model.json")
        else:
            outs = {name: out for name, out in (("vision", args.vision_out), ("llm", args.llm_out)) if out}
            if not outs:
                raise HFMappingError("give --vision-out and/or --llm-out")
            export_checkpoint(args.load, outs, args.model_sizes)
            print("wrote " + ", ".join(outs.values()))
    except (HFMappingError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
