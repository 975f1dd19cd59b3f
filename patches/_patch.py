"""How a patch replaces an upstream function: checked, idempotent, reversible in tests.

Each patch names the upstream attribute it replaces and the parameters it relies on. If megatron-core
moved or changed it, apply() fails with one line saying which function and what changed, instead of
a wrong run later.
"""

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import megatron.core

TARGET_VERSION = "0.19"  # the megatron-core minor version these patches were written against


class PatchError(RuntimeError):
    """Upstream code is not what a patch was written for; one line naming it."""


@dataclass
class Replacement:
    owner: object
    name: str
    original: Callable


# (owner, attribute, patch) -> what it replaced: applying a patch twice does nothing; two patches of
# one function chain (the later wraps the earlier).
_applied: dict[tuple[int, str, Callable], Replacement] = {}


def upstream(path: str):
    """(owner object, attribute name, current value) for 'package.module.attr' or 'package.module.Class.attr'."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:-1]:  # a class (or a module attribute) on the way to the target
            owner = getattr(owner, attr, None)
        if owner is None or not hasattr(owner, parts[-1]):
            break
        return owner, parts[-1], getattr(owner, parts[-1])
    raise PatchError(f"megatron-hetero patch target {path} not found in megatron-core "
                     f"{megatron.core.__version__} (written for {TARGET_VERSION}.x)")


def replace(path: str, make: Callable[[Callable], Callable], params: tuple[str, ...] = ()) -> None:
    """Replace the upstream callable at `path` by make(original). `params`: parameter names the
    replacement relies on; checked against the upstream signature."""
    owner, name, current = upstream(path)
    key = (id(owner), name, make)
    if key in _applied:
        return
    if params:
        found = set(inspect.signature(inspect.unwrap(current)).parameters)
        missing = [p for p in params if p not in found]
        if missing:
            raise PatchError(f"megatron-hetero patch for {path}: upstream signature lacks {missing} "
                             f"(megatron-core {megatron.core.__version__}, written for {TARGET_VERSION}.x)")
    new = make(current)
    new.__wrapped__ = current
    setattr(owner, name, new)
    _applied[key] = Replacement(owner, name, current)


def check_version() -> None:
    if not megatron.core.__version__.startswith(TARGET_VERSION + "."):
        raise PatchError(f"megatron-hetero's patches target megatron-core {TARGET_VERSION}.x; found "
                         f"{megatron.core.__version__}: install megatron-core>={TARGET_VERSION},<0.20")
