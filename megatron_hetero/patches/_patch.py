"""How a patch changes upstream code: one mechanism that checks what it replaces, records it, and can
undo it.

Every change megatron-hetero makes to megatron-core, megatron.training or torch goes through here:
- `replace(path, make, params)`: the object at `path` becomes make(current). A function: `params`
  names the parameters the replacement relies on, checked against the upstream signature (`()`: it
  passes every argument through and relies on none); a class or another object: `kind`, the type it
  must have;
- `set_value(path, value, kind)`: a module attribute set to a value (`create`: where upstream leaves
  it out, e.g. an optional extension's module that failed to import);
- `provide_module(name, module)`: a module importable by name that upstream imports optionally;
- `enter(context)`: a context (a TorchFunctionMode) entered for the life of the process;
- `temporarily(path, make, params)`: a replacement inside a `with` block only (upstream code run
  once with another process group).
If megatron-core moved or changed a target, the patch fails with one line (PatchError) saying which
and what changed, instead of a wrong run later. Each change is recorded (`applied`) and `undo()`
restores everything in reverse order (the tests undo them). Applying a patch twice changes nothing.
"""

import contextlib
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import megatron.core

TARGET_VERSION = "0.19"  # the megatron-core minor version these patches were written against
PASS_THROUGH = ()  # `params` of a replacement that passes every argument through unchanged
_ABSENT = object()  # what an attribute was before a patch created it


class PatchError(RuntimeError):
    """Upstream code is not what a patch was written for; one line naming it."""


@dataclass
class Change:
    """One recorded change: `owner`'s `name` (an attribute, or with `item` a key of the mapping
    `owner`) was `original` before, `new` after; or with `context` a context entered."""

    path: str
    owner: object = None
    name: str = ""
    original: object = _ABSENT
    new: object = None
    item: bool = False
    context: object = None

    def undo(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
        elif self.item and self.original is _ABSENT:
            self.owner.pop(self.name, None)
        elif self.item:
            self.owner[self.name] = self.original
        elif self.original is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


_changes: list[Change] = []  # in the order applied
_seen: set = set()  # (owner id, name, maker) of the changes made: a second apply() does nothing


def _error(path: str, what: str) -> PatchError:
    return PatchError(f"megatron-hetero patch for {path}: {what} (megatron-core {megatron.core.__version__}, "
                      f"written for {TARGET_VERSION}.x)")


def upstream(path: str, create: bool = False):
    """(owner object, attribute name, current value) for 'package.module.attr' or
    'package.module.Class.attr'; with `create`, the value may be absent (_ABSENT)."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:-1]:  # a class (or a module attribute) on the way to the target
            owner = getattr(owner, attr, None)
        if owner is None or not (create or hasattr(owner, parts[-1])):
            break
        return owner, parts[-1], getattr(owner, parts[-1], _ABSENT)
    raise PatchError(f"megatron-hetero patch target {path} not found in megatron-core "
                     f"{megatron.core.__version__} (written for {TARGET_VERSION}.x)")


def check(path: str, current, params: tuple[str, ...] | None, kind: type | None) -> None:
    """What a patch relies on at `path`: a function's parameters, another object's type."""
    if kind is not None and not isinstance(current, kind):
        raise _error(path, f"upstream holds a {type(current).__name__} there, not a {kind.__name__}")
    if kind is None and params is None:
        raise AssertionError(f"the patch of {path} names the parameters it relies on (or PASS_THROUGH) or a kind")
    if params:
        try:
            found = set(inspect.signature(inspect.unwrap(current)).parameters)
        except (TypeError, ValueError):
            raise _error(path, "upstream has no signature to check") from None
        missing = [p for p in params if p not in found]
        if missing:
            raise _error(path, f"upstream signature lacks {missing}")


def replace(path: str, make: Callable, params: tuple[str, ...] | None = None, kind: type | None = None) -> None:
    """Replace the upstream object at `path` by make(current), checked (see the module docstring)."""
    owner, name, current = upstream(path)
    if (id(owner), name, make) in _seen:
        return
    check(path, current, params, kind)
    new = make(current)
    new.__wrapped__ = current
    _record(Change(path, owner, name, current, new), make)
    setattr(owner, name, new)


def set_value(path: str, value, kind: type, create: bool = False) -> None:
    """Set the module attribute at `path` to `value` (its upstream value of type `kind`, or absent
    with `create`)."""
    owner, name, current = upstream(path, create)
    if (id(owner), name, "value") in _seen:
        return
    if current is not _ABSENT:
        check(path, current, None, kind)
    _record(Change(path, owner, name, current, value), "value")
    setattr(owner, name, value)


def provide_module(name: str, module) -> None:
    """`import name` gives `module` (upstream imports it optionally: an extension it lacks)."""
    if (id(sys.modules), name, "module") in _seen:
        return
    _record(Change(f"sys.modules[{name!r}]", sys.modules, name, sys.modules.get(name, _ABSENT), module, item=True),
            "module")
    sys.modules[name] = module


def enter(path: str, context) -> None:
    """Enter `context` for the life of the process (until undo); `path` names it in the record."""
    if (id(context), path, "context") in _seen:
        return
    context.__enter__()
    _record(Change(path, context=context), "context", key=(id(context), path))


def _record(change: Change, maker, key=None) -> None:
    _seen.add((*(key or (id(change.owner), change.name)), maker))
    _changes.append(change)


@contextlib.contextmanager
def temporarily(path: str, make: Callable, params: tuple[str, ...] | None = None):
    """Replace the upstream object at `path` by make(current) inside the block only."""
    owner, name, current = upstream(path)
    check(path, current, params, None)
    setattr(owner, name, make(current))
    try:
        yield
    finally:
        setattr(owner, name, current)


def applied() -> list[str]:
    """The paths changed, in the order applied."""
    return [change.path for change in _changes]


def undo() -> None:
    """Every recorded change undone, the last first; apply() may then apply them again."""
    while _changes:
        _changes.pop().undo()
    _seen.clear()


def check_version() -> None:
    if not megatron.core.__version__.startswith(TARGET_VERSION + "."):
        raise PatchError(f"megatron-hetero's patches target megatron-core {TARGET_VERSION}.x; found "
                         f"{megatron.core.__version__}: install megatron-core>={TARGET_VERSION},<0.20")
