"""A model family: its Hugging Face config fields and weights mapped to our ModelSizes and full
state dict, both ways, from one table of fields and one list of weight rules."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from megatron_hetero.hf.rules import HFMappingError, apply_rules
from megatron_hetero.models.sizes import ModelSizes

_UNSET = object()


def _get(config, path: str, default=_UNSET):
    """config.a["b"] for path "a.b" (Hugging Face configs nest some fields in dicts, e.g. rope_parameters)."""
    value = config
    for key in path.split("."):
        value = value.get(key, _UNSET) if isinstance(value, dict) else getattr(value, key, _UNSET)
        if value is _UNSET:
            if default is _UNSET:
                raise HFMappingError(f"config field {path} is missing; is it a config of this family?")
            return default
    return value


def _set(values: dict, path: str, value) -> None:
    head, _, rest = path.partition(".")
    if rest:
        _set(values.setdefault(head, {}), rest, value)
    else:
        values[head] = value


@dataclass(frozen=True)
class Field:
    """A Hugging Face config field (`hf`, dotted into dicts and sub-configs) equal to one of ours: a
    ModelSizes field or, prefixed "arch.", a field of the module's arch (LLMArch or VisionArch), or,
    prefixed "family.", a value of ModelSizes.family_arch (a VLM family's own settings)."""

    hf: str
    ours: str
    default: object = _UNSET  # when the Hugging Face config lacks the field (None: ours derives it)
    choices: tuple = ()  # the values we support, when not all are


@dataclass(frozen=True)
class Family:
    """name: ours; model_type: config.json's; module: "llm" or "vision" (what our builders build,
    and the ModelSizes arch it sets, llm_arch or vision_arch); hf_fixed: config values the mapping
    assumes (checked on import, written on export); arch: our arch fields the family implies;
    rules(sizes): the weight rules; hf_dropped: Hugging Face key prefixes we have no counterpart for
    (e.g. SigLIP's pooling head), dropped on import; ours_only: our key prefixes Hugging Face has no
    counterpart for (an encoder's projector), absent on import and left out on export; hf_prefix:
    where a model that holds ours as a part keeps its keys (a CLIP text + vision checkpoint's
    "vision_model."): with such keys, only they are imported."""

    name: str
    model_type: str
    architecture: str
    module: str
    fields: tuple[Field, ...]
    hf_fixed: dict
    arch: dict
    rules: Callable[[ModelSizes], list]
    hf_dropped: tuple[str, ...] = ()
    ours_only: tuple[str, ...] = ()
    hf_export: dict = field(default_factory=dict)  # further values written on export only
    hf_prefix: str = ""

    @property
    def _arch_field(self) -> str:
        return f"{self.module}_arch"

    def sizes(self, config, base: ModelSizes = ModelSizes()) -> ModelSizes:
        """`base` with this family's module set from a Hugging Face config (other modules' fields kept)."""
        for path, want in self.hf_fixed.items():
            got = _get(config, path, want)
            if got != want:
                raise HFMappingError(f"{self.name}: config {path} = {got!r} is not supported; "
                                     f"only {want!r} maps onto our modules")
        sizes, arch, family = {}, dict(self.arch), dict(base.family_arch)
        for f in self.fields:
            value = _get(config, f.hf, f.default)
            if f.choices and value not in f.choices:
                raise HFMappingError(f"{self.name}: config {f.hf} = {value!r} is not supported; "
                                     f"use one of {', '.join(map(repr, f.choices))}")
            kind, _, name = f.ours.rpartition(".")
            {"arch": arch, "family": family, "": sizes}[kind][name] = value
        arch_cls = type(getattr(base, self._arch_field))
        return replace(base, **sizes, **{self._arch_field: arch_cls(**arch)}, family_arch=family)

    def config(self, sizes: ModelSizes, base=None):
        """The Hugging Face config of our module: our fields written over `base` (e.g. the imported
        config: the fields we do not model, token ids say, carry over) or the family's defaults."""
        from transformers import AutoConfig

        values = {k: v for k, v in base.to_dict().items() if k != "model_type"} if base is not None else {}
        arch = getattr(sizes, self._arch_field)
        for f in self.fields:
            name = f.ours.removeprefix("arch.")
            value = getattr(arch if f.ours.startswith("arch.") else sizes, name)
            if value is not None:  # None: Hugging Face derives it as we do
                _set(values, f.hf, value)
        for path, value in {**self.hf_fixed, **self.hf_export}.items():
            _set(values, path, value)
        values["architectures"] = [self.architecture]
        return AutoConfig.for_model(self.model_type, **values)

    def to_ours(self, hf_state: dict[str, torch.Tensor], sizes: ModelSizes) -> dict[str, torch.Tensor]:
        """Our module's full (TP1/PP1) state dict, but for `ours_only`, from a Hugging Face state dict."""
        if self.hf_prefix and any(name.startswith(self.hf_prefix) for name in hf_state):
            hf_state = {name.removeprefix(self.hf_prefix): t for name, t in hf_state.items()
                        if name.startswith(self.hf_prefix)}
        return apply_rules(self.rules(sizes), hf_state, to_hf=False, ignored=self.hf_dropped)

    def to_hf(self, state: dict[str, torch.Tensor], sizes: ModelSizes) -> dict[str, torch.Tensor]:
        """The Hugging Face state dict (as save_pretrained writes it) of our module's full state dict."""
        return apply_rules(self.rules(sizes), state, to_hf=True, ignored=self.ours_only)

