"""`megatron-hetero`: one command for everything megatron-hetero does outside a training script.

    megatron-hetero layout check L.yaml --world-size N [--model-sizes CKPT/model.json]
    megatron-hetero layout show L.yaml --world-size N
    megatron-hetero plan --workload W1 --gpus 2 [--gpu h100] [--write-yaml best.yaml]
    torchrun --nproc-per-node N --no-python megatron-hetero verify L.yaml
    megatron-hetero hf import|compare|export ...
    torchrun --nproc-per-node N --no-python megatron-hetero launch SCRIPT.py <its flags> --hetero-layout L.yaml
    megatron-hetero breakdown RECORDS.jsonl --png F      # a benchmark record's step per rank
    megatron-hetero timeline METRICS.jsonl --png F       # a run's step per rank on a time axis
    megatron-hetero kernels check [attention|cp-chunks|norms|mlp|experts|loss|triton|all] [--record]   # on a GPU

`megatron-hetero COMMAND --help` describes each. The `python -m megatron_hetero.layout|hf|launch`
forms and `python -m megatron_hetero.cli` run the same code.
"""

import sys

import megatron_hetero

# Each command: what it does, and the "module:function" run with the remaining arguments and its
# name (hf and launch keep their `python -m megatron_hetero.hf|launch` forms: their modules' main).
COMMANDS = dict(
    layout=("check a layout file and show its rank map and process groups", "megatron_hetero.layout:main"),
    plan=("predict every layout's step time and memory; write the best", "megatron_hetero.cli.plan:main"),
    verify=("check a layout's boundaries on your cluster (under torchrun)", "megatron_hetero.cli.verify:main"),
    hf=("Hugging Face weights: import, compare, export", "megatron_hetero.hf.__main__:main"),
    launch=("run a Megatron-LM pretrain script with the patches applied", "megatron_hetero.launch:main"),
    breakdown=("draw a benchmark record's step per rank", "megatron_hetero.cli.picture:breakdown_main"),
    timeline=("draw a run's step per rank on a time axis", "megatron_hetero.cli.picture:timeline_main"),
    kernels=("check the fast kernels on this GPU; enable what passes", "megatron_hetero.cli.kernels:main"),
)


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (what, _) in COMMANDS.items()]
    return ("usage: megatron-hetero [--version] COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n" + __doc__.split("\n\n")[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"megatron-hetero {megatron_hetero.__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (megatron-hetero --help)",
              file=sys.stderr)
        return 2
    import importlib

    from megatron_hetero.models.accelerators import ignore_missing_warnings

    ignore_missing_warnings()  # before a command imports megatron-core
    module, _, function = COMMANDS[argv[0]][1].partition(":")
    return getattr(importlib.import_module(module), function)(argv[1:], prog=f"megatron-hetero {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
