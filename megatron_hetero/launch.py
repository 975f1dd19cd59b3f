"""Run a Megatron-LM pretrain script with megatron-hetero's patches applied.

    torchrun --nproc-per-node N -m megatron_hetero.launch pretrain_vlm.py <its flags> --hetero-layout L.yaml
    torchrun --nproc-per-node N --no-python megatron-hetero launch pretrain_vlm.py <its flags> --hetero-layout L.yaml

The script runs as `__main__` with its own flags (`@file` argument files expanded first), its
directory first on `sys.path` as when Python runs it directly. `SCRIPT.py --help` prints the script's
flags with megatron-hetero's among them. Under `--hetero-layout` the scripts accepted are Megatron-LM's
pretrain_vlm.py and megatron-hetero's examples/pretrain_vlm.py; without it any script runs as it does
without the plugin.
"""

import os
import runpy
import sys

from megatron_hetero.spec.arg_files import expand_arg_files


def main(argv: list[str] | None = None, prog: str = "python -m megatron_hetero.launch") -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: {prog} SCRIPT.py [script flags] [--hetero-layout FILE]"
    if argv and argv[0] in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if not argv or not argv[0].endswith(".py"):
        print(f"{usage}\n({prog} --help describes it)", file=sys.stderr)
        return 2
    script, flags = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"error: script {script} not found", file=sys.stderr)
        return 2
    try:
        flags = expand_arg_files(flags)
    except OSError as error:
        print(f"error: argument file {error.filename}: {error.strerror}", file=sys.stderr)
        return 2

    import megatron_hetero.patches

    try:
        megatron_hetero.patches.apply()
    except megatron_hetero.patches.PatchError as error:  # installed megatron-core is not what they target
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.argv = [script, *flags]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
