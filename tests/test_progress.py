"""The progress bar of `hf import` / `hf export` (megatron_hetero/convert/progress.py): on a terminal
it counts every tensor's bytes read from safetensors files and a stage's bytes when it ends, to the
files' total; with quiet, or where stderr is no terminal, it writes nothing. (On the command line:
tests/test_hub.py.)"""

import io

import torch
from safetensors.torch import save_file

from megatron_hetero.convert.progress import Progress, read_safetensors, state_bytes


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _files(tmp_path):
    tensors = [{"a": torch.randn(64, 64), "b": torch.ones(300)}, {"c": torch.zeros(8, dtype=torch.bfloat16)}]
    for n, state in enumerate(tensors):
        save_file(state, tmp_path / f"model-{n}.safetensors")
    return sorted(tmp_path.glob("*.safetensors")), {k: t for state in tensors for k, t in state.items()}


def test_bar_counts_each_tensor_and_stage(tmp_path):
    files, expected = _files(tmp_path)
    terminal = Terminal()
    with Progress("import", file=terminal) as progress:
        read = read_safetensors(files, progress)
        assert progress.bar.n == progress.bar.total == state_bytes(expected)
        with progress.stage("writing the checkpoint", state_bytes(read)):
            assert terminal.getvalue().endswith("writing the checkpoint]")
        done = progress.bar.n
    assert read.keys() == expected.keys() and all(torch.equal(read[k], t) for k, t in expected.items())
    assert done == 2 * state_bytes(expected) and "import:" in terminal.getvalue()


def test_quiet_or_no_terminal_writes_nothing(tmp_path):
    files, _ = _files(tmp_path)
    for progress, out in ((Progress("import", quiet=True, file=(t := Terminal())), t),
                          (Progress("import", file=(f := io.StringIO())), f)):
        with progress:
            read_safetensors(files, progress)
        assert out.getvalue() == ""
