"""Hugging Face weights in and out of Megatron checkpoints of our modules (`megatron-hetero hf` or
`python -m megatron_hetero.hf`):

    python -m megatron_hetero.hf import --model HF_DIR --save CKPT            # a whole VLM (Qwen2.5-VL, ...)
    python -m megatron_hetero.hf import --vision HF_DIR --llm HF_DIR --save CKPT [--projector FILE]
    python -m megatron_hetero.hf export --load CKPT --out DIR [--model-sizes FILE]
    python -m megatron_hetero.hf export --load CKPT --vision-out DIR --llm-out DIR [--model-sizes FILE]
    python -m megatron_hetero.hf compare --model HF_DIR --load CKPT --data-path FILE [...]

HF_DIR: a model directory, or a Hub id (ORG/NAME[@REVISION]) resolved through huggingface_hub's cache
(downloaded where online; HF_HUB_OFFLINE=1 reads the cache only).

Train from an import with examples/pretrain_vlm.py ... --load CKPT --model-sizes CKPT/model.json
(any layout). Mistakes are one `error:` line and exit code 2.
"""

import argparse
import sys

from megatron_hetero.convert.progress import Progress
from megatron_hetero.convert.rules import HFMappingError

QUIET_HELP = "no progress bar (it is shown only where stderr is a terminal)"


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face directories -> a Megatron checkpoint")
    imp.add_argument("--model", help="a whole VLM's model directory or Hub id (config.json model_type: "
                                  "qwen2_5_vl, internvl, qwen3_vl, qwen3_vl_moe, qwen2_5_omni, qwen3_omni_moe)")
    imp.add_argument("--vision", help="a SigLIP or CLIP (vision) model directory or Hub id")
    imp.add_argument("--llm", help="a Llama, Qwen2 or Qwen3 model directory or Hub id")
    imp.add_argument("--save", required=True, help="the checkpoint directory to write")
    imp.add_argument("--projector", help="a safetensors file of the projector's weights (our names, "
                                         "projector.*); without it the projector is newly initialized")
    imp.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    exp = commands.add_parser("export", help="a Megatron checkpoint -> Hugging Face directories")
    exp.add_argument("--load", required=True, help="a checkpoint directory (its tracker's iteration)")
    exp.add_argument("--out", help="the directory of a whole VLM (a --model import)")
    exp.add_argument("--vision-out", help="the vision tower's directory (a --vision/--llm import)")
    exp.add_argument("--llm-out", help="the LLM's directory (a --vision/--llm import)")
    exp.add_argument("--model-sizes", help="the model.json of the import (default: the one the checkpoint records)")
    exp.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    from megatron_hetero.hf.compare import add_arguments

    add_arguments(commands.add_parser("compare", help="transformers' forward against ours on the same samples"))
    return parser


def _import(args) -> str:
    from megatron_hetero.hf.checkpoint import import_checkpoint
    from megatron_hetero.hf.whole_model import import_model

    if args.model and (args.vision or args.llm or args.projector):
        raise HFMappingError("give either --model (a whole VLM) or --vision and --llm, not both")
    if not (args.model or (args.vision and args.llm)):
        raise HFMappingError("give --model HF_DIR (a whole VLM), or --vision HF_DIR and --llm HF_DIR")
    with Progress("import", args.quiet) as progress:
        if args.model:
            path = import_model(args.model, args.save, progress)
        else:
            path = import_checkpoint(args.vision, args.llm, args.save, args.projector, progress)
    return f"wrote {path}/release; train from it with: --load {path} --model-sizes {path}/model.json"


def _export(args) -> str:
    from megatron_hetero.hf.checkpoint import export_checkpoint
    from megatron_hetero.hf.whole_model import export_model

    outs = {name: out for name, out in (("vision", args.vision_out), ("llm", args.llm_out)) if out}
    if args.out and outs:
        raise HFMappingError("give either --out (a whole VLM) or --vision-out/--llm-out, not both")
    if not (args.out or outs):
        raise HFMappingError("give --out DIR (a whole VLM), or --vision-out and/or --llm-out")
    with Progress("export", args.quiet) as progress:
        if args.out:
            return f"wrote {export_model(args.load, args.out, args.model_sizes, progress)}"
        export_checkpoint(args.load, outs, args.model_sizes, progress)
    return "wrote " + ", ".join(outs.values())


def main(argv: list[str] | None = None, prog: str = "python -m megatron_hetero.hf") -> int:
    args = _parser(prog).parse_args(argv)
    import megatron_hetero.patches

    megatron_hetero.patches.apply()  # megatron-core on CPUs; this command line is an entry point
    try:
        from megatron_hetero.hf.hub import resolve_model

        for flag in ("model", "vision", "llm"):  # a directory, or a Hub id through the cache
            if getattr(args, flag, None):
                setattr(args, flag, resolve_model(getattr(args, flag), f"--{flag}"))
        if args.command == "compare":
            from megatron_hetero.hf.compare import compare

            return compare(args)
        print(_import(args) if args.command == "import" else _export(args))
    except (HFMappingError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
