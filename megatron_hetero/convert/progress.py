"""The progress bar of `hf import` and `hf export` (tqdm, in bytes): multi-GB checkpoints take minutes.
It advances per tensor read from the model's *.safetensors files (import) or converted to the files'
dtypes (export), and by a stage's bytes when a stage that is one call (the checkpoint's write or
read, the safetensors file's write) ends, its name shown meanwhile. Shown only where stderr is a
terminal (tqdm's disable=None), never when quiet."""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class Progress:
    """One bar of `desc`; its total grows as the work it counts becomes known."""

    def __init__(self, desc: str, quiet: bool = False, file=None):
        from tqdm import tqdm

        self.bar = tqdm(desc=desc, total=0, unit="B", unit_scale=True, unit_divisor=1024, file=file,
                        disable=True if quiet else None, dynamic_ncols=True)

    def expect(self, nbytes: int) -> None:
        self.bar.total += nbytes
        self.bar.refresh()

    def done(self, nbytes: int) -> None:
        """Work of `nbytes` that became known as it ended."""
        self.expect(nbytes)
        self.bar.update(nbytes)

    def tensors(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`items` (name, tensor) passed through, the bar advancing by each tensor's bytes (expected
        beforehand with `expect`)."""
        for name, tensor in items:
            yield name, tensor
            self.bar.update(tensor.nbytes)

    @contextmanager
    def stage(self, name: str, nbytes: int = 0, expected: bool = False):
        """A step of `nbytes` (0: counted by the caller once known; expected: already in the total)
        done in one call: its name on the bar while it runs."""
        if not expected:
            self.expect(nbytes)
        self.bar.set_postfix_str(name)
        yield
        self.bar.update(nbytes)
        self.bar.set_postfix_str("")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def quiet() -> Progress:
    """The bar of a library call that was given none: never shown."""
    return Progress("", quiet=True)


def state_bytes(states: dict) -> int:
    """The bytes of a state dict's tensors, or of a dict of them."""
    return sum(state_bytes(v) if isinstance(v, dict) else v.nbytes for v in states.values())


def _tensor_bytes(file) -> int:
    """A safetensors file's bytes of tensors: all but its header (8 bytes of its length, then JSON)."""
    with open(file, "rb") as f:
        return file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


def read_safetensors(files: list, progress: Progress) -> dict[str, torch.Tensor]:
    """The tensors of safetensors `files`, read one by one with the bar advancing."""
    from safetensors import safe_open

    progress.expect(sum(_tensor_bytes(file) for file in files))
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            tensors.update(progress.tensors((key, handle.get_tensor(key)) for key in handle.keys()))
    return tensors
