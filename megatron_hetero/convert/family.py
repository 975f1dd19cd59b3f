"""A model family: its Hugging Face config fields and weights mapped to our ModelSizes and full
state dict, both ways, from one table of fields and one list of weight rules."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from megatron_hetero.convert.rules import HFMappingError, apply_rules
from megatron_hetero.spec.sizes import ModelSizes

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
    """name: ours; model_type: config.json's; module: "llm", "vision" or "audio" (what our builders
    build, and the ModelSizes arch it sets where there is one, llm_arch or vision_arch); hf_fixed:
    config values the mapping assumes (checked on import, written on export); arch: our arch fields
    the family implies;
    rules(sizes): the weight rules; hf_kept: Hugging Face key prefixes of tensors our module does not
    hold (SigLIP's pooling head, older files' position ids): carried unchanged from import to export
    (`untrained`); hf_tied: (name, the name it is tied to) of a tensor that is another one again (a
    tied lm_head in a file): checked equal on import, left to transformers' tying on export;
    ours_only: our key prefixes Hugging Face has no counterpart for (an encoder's projector), absent
    on import and left out on export; hf_prefix: where a model that holds ours as a part keeps its
    keys (a CLIP text + vision checkpoint's "vision_model."): with such keys, only they are ours;
    pixels: vision, the image processor's (mean, std) where a directory has no
    preprocessor_config.json (transformers' defaults for the family)."""

    name: str
    model_type: str
    architecture: str
    module: str
    fields: tuple[Field, ...]
    hf_fixed: dict
    arch: dict
    rules: Callable[[ModelSizes], list]
    hf_kept: tuple[str, ...] = ()
    hf_tied: tuple[tuple[str, str], ...] = ()
    ours_only: tuple[str, ...] = ()
    hf_export: dict = field(default_factory=dict)  # config values written on export without a base config
    hf_prefix: str = ""
    pixels: tuple | None = None

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
        if hasattr(base, self._arch_field):
            sizes[self._arch_field] = type(getattr(base, self._arch_field))(**arch)
        return replace(base, **sizes, family_arch=family)

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
        for path, value in {**({} if base is not None else self.hf_export), **self.hf_fixed}.items():
            _set(values, path, value)
        values["architectures"] = values.get("architectures") or [self.architecture]
        return AutoConfig.for_model(self.model_type, **values)

    def prefix(self, hf_state: dict) -> str:
        """The prefix of our keys in `hf_state` ("" where they have none)."""
        return self.hf_prefix if self.hf_prefix and any(n.startswith(self.hf_prefix) for n in hf_state) else ""

    def to_ours(self, hf_state: dict[str, torch.Tensor], sizes: ModelSizes) -> dict[str, torch.Tensor]:
        """Our module's full (TP1/PP1) state dict, but for `ours_only`, from a Hugging Face state dict."""
        prefix, rules = self.prefix(hf_state), self.rules(sizes)
        ours = {name.removeprefix(prefix): t for name, t in hf_state.items() if name.startswith(prefix)}
        read = {name for rule in rules for name in rule.hf}
        tied = tuple(name for name, _ in self.hf_tied if name not in read)  # untied, a rule reads it
        for name, source in self.hf_tied:
            if name in tied and name in ours and not torch.equal(ours[name], ours[source]):
                raise HFMappingError(f"{prefix}{name} differs from {prefix}{source}, to which the config ties it "
                                     f"(tie_word_embeddings); set it false or save the model again")
        return apply_rules(rules, ours, to_hf=False, ignored=self.hf_kept + tied)

    def untrained(self, hf_state: dict[str, torch.Tensor], whole_file: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of `hf_state` our module does not hold, under their names there, to write back
        unchanged on export: ours under `hf_kept`, and with `whole_file` (the file holds this
        family's model, not a larger one around it, e.g. a vision tower with a projection) those
        outside our prefix."""
        prefix = self.prefix(hf_state)
        kept = self.hf_kept
        return {name: t for name, t in hf_state.items()
                if (name.removeprefix(prefix).startswith(kept) if name.startswith(prefix) else whole_file)}

    def to_hf(self, state: dict[str, torch.Tensor], sizes: ModelSizes, prefix: str = "") -> dict[str, torch.Tensor]:
        """The Hugging Face state dict (as save_pretrained writes it) of our module's full state dict,
        its keys under `prefix` (where the imported file had them)."""
        out = apply_rules(self.rules(sizes), state, to_hf=True, ignored=self.ours_only)
        return {prefix + name: t for name, t in out.items()}
