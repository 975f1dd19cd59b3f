"""What a VLM family provides: a whole Hugging Face VLM (config.json's model_type: qwen2_5_vl,
internvl, ...) mapped onto our two modules, `vision` (role encoder) and `llm`, each trained under its
own layout.

A family is data plus a few functions: per module a `hf.family.Family` (its config fields into
ModelSizes, "family." fields into ModelSizes.family_arch, and its weight rules, written in the key
names transformers 5 uses in memory), the other spellings of those keys that files use
(`KeyScheme`: the Hub's published checkpoints), its vision builder, its image processing for the data
and its image processor's settings. Everything that differs between families is reached through
`families.family_named(sizes.family)`; the boundary, schedules and LLM are shared.
"""

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from megatron_hetero.convert.family import Family
from megatron_hetero.convert.rules import HFMappingError, apply_rules
from megatron_hetero.spec.sizes import ModelSizes


@dataclass(frozen=True)
class KeyScheme:
    """How a checkpoint's files spell the tensors whose in-memory (transformers 5) names the rules
    use: prefix renames (in-memory prefix, file prefix), the first match wins; none: the same names.
    Where renames cannot say it (the files hold as one tensor what transformers keeps apart, e.g.
    InternVL's published fused `attn.qkv`), `rules(sizes)` gives module name -> the weight rules in
    the files' own names, and renames only spell the copies (`VLMFamily.copies`). Where schemes
    share names but not layouts (Qwen3-VL-MoE's fused experts, transposed on the Hub), `shapes(sizes)`
    gives the files' shapes of those tensors (files' names -> shape): the files' shapes pick it."""

    name: str
    renames: tuple[tuple[str, str], ...] = ()
    rules: Callable[[ModelSizes], dict[str, list]] | None = None
    shapes: Callable[[ModelSizes], dict[str, tuple[int, ...]]] | None = None

    def to_memory(self, key: str) -> str:
        for memory, file in self.renames:
            if key.startswith(file):
                return memory + key[len(file):]
        return key

    def to_file(self, key: str) -> str:
        for memory, file in self.renames:
            if key.startswith(memory):
                return file + key[len(memory):]
        return key


TRANSFORMERS = KeyScheme("transformers")


def _call(path: str, *args, **kwargs):
    """The function at "module:attribute", imported on first use (megatron-core and transformers are
    heavy: the registry is read before either is needed)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


@dataclass(frozen=True)
class VLMFamily:
    """name: ours (ModelSizes.family; the registry, families/__init__.py, says which config.json
    model_types it imports); architecture: the transformers class of the whole model; parts: module
    name ("vision", "llm") -> its mapping; prefixes: module name -> the in-memory key prefixes of its
    tensors; schemes: the key spellings files may use (the first, in-memory, is transformers');
    finish(sizes, config): the family's further sizes and checks across modules; vision_builder,
    media_builder, settings_reader: "module:function" paths (see build_vision, media,
    processor_settings); audio_builder: the audio encoder's builder (families with an "audio"
    part); vision_stages: whether the vision module may have pp > 1; vision_cp, audio_cp: whether the
    vision module, the audio module may have cp > 1 (its ranks splitting each item); kept: the
    in-memory key prefixes of tensors no module holds (an omni model's speech generator), carried
    from import to export unchanged; compared: the transformers class of the part our modules are
    (an omni model's thinker; "": the whole model's `architecture`), which `hf compare` runs."""

    name: str
    architecture: str
    parts: dict[str, Family]
    prefixes: dict[str, tuple[str, ...]]
    vision_builder: str
    media_builder: str
    settings_reader: str
    finish: Callable[[ModelSizes, object], ModelSizes] = lambda sizes, config: sizes
    schemes: tuple[KeyScheme, ...] = field(default=(TRANSFORMERS,))
    # in-memory keys whose tensors are copies of others (tied embeddings) -> the key they copy:
    # the rules read only the original; an export writes a copy where the imported files had it
    copies: Callable[[ModelSizes], dict[str, str]] = lambda sizes: {}
    # the vision tower splits over pipeline stages (the vision module's pp; a StageEncoder's stages)
    vision_stages: bool = False
    # the vision tower splits each image over the vision module's CP ranks (whole merge blocks:
    # models/varlen.py, CPSplit)
    vision_cp: bool = False
    # DeepStack (Qwen3-VL): the vision layers whose extra rows go to LLM layers 0, 1, ... (the tower
    # sends them as extra columns of its rows: models/deepstack.py); () for none
    deepstack: Callable[[ModelSizes], tuple[int, ...]] = lambda sizes: ()
    audio_builder: str = ""
    # the audio encoder splits each audio over the audio module's CP ranks (by rows:
    # families/qwen2_5_omni/audio.py)
    audio_cp: bool = False
    kept: tuple[str, ...] = ()
    compared: str = ""

    # ---- Hugging Face config and weights ---------------------------------------------------------
    def sizes(self, config, base: ModelSizes = ModelSizes()) -> ModelSizes:
        """Every module's sizes from the whole model's Hugging Face config."""
        sizes = replace(base, family=self.name, family_arch={})
        for part in self.parts.values():
            sizes = part.sizes(config, sizes)
        return self.finish(sizes, config)

    def scheme_of(self, keys, sizes: ModelSizes) -> KeyScheme:
        """The scheme whose spelling every key of a checkpoint's files has."""
        known = {name for part in self.parts.values() for rule in part.rules(sizes) for name in rule.hf}
        known |= set(self.copies(sizes))
        unknown = {scheme.name: self._unknown(keys, sizes, scheme, known) + self._misshapen(keys, sizes, scheme)
                   for scheme in self.schemes}
        best = min(self.schemes, key=lambda scheme: len(unknown[scheme.name]))
        if unknown[best.name]:  # named in the spelling most of the files' keys have
            raise HFMappingError(f"{self.name}: tensor {unknown[best.name][0]} is no tensor of this family's "
                                 f"checkpoints (in {best.name} key names); is it a {self.name} model?")
        return best

    def _unknown(self, keys, sizes: ModelSizes, scheme: KeyScheme, known: set) -> list[str]:
        """The keys `scheme` does not spell (every tensor of the files is read: none is dropped);
        known = the in-memory names of the rules and copies; the kept tensors are known in any scheme."""
        keys = [key for key in keys if not scheme.to_memory(key).startswith(self.kept)] if self.kept else keys
        if scheme.rules is not None:  # the files' own names
            names = {name for rules in scheme.rules(sizes).values() for rule in rules for name in rule.hf}
            return [key for key in keys if key not in names and scheme.to_memory(key) not in self.copies(sizes)]
        return [key for key in keys if scheme.to_memory(key) not in known]

    @staticmethod
    def _misshapen(tensors, sizes: ModelSizes, scheme: KeyScheme) -> list[str]:
        """The files' tensors (a dict; keys alone say nothing) whose shape is not `scheme`'s."""
        if scheme.shapes is None or not isinstance(tensors, dict):
            return []
        want = scheme.shapes(sizes)
        return [key for key, tensor in tensors.items() if key in want and tuple(tensor.shape) != want[key]]

    def is_kept(self, key: str) -> bool:
        """Whether in-memory key `key` is a tensor no module holds (`kept`)."""
        return bool(self.kept) and key.startswith(self.kept)

    def kept_tensors(self, hf_state: dict[str, torch.Tensor], scheme: KeyScheme) -> dict[str, torch.Tensor]:
        """The files' tensors no module holds, under the files' names."""
        return {key: t for key, t in hf_state.items() if self.is_kept(scheme.to_memory(key))}

    def _module_of(self, key: str) -> str:
        for name, prefixes in self.prefixes.items():
            if key.startswith(prefixes):
                return name
        raise HFMappingError(f"{self.name}: tensor {key} belongs to none of its modules")

    def to_ours(self, hf_state: dict[str, torch.Tensor], sizes: ModelSizes,
                scheme: KeyScheme = TRANSFORMERS) -> dict[str, dict[str, torch.Tensor]]:
        """module name -> our module's full (TP1/PP1) state dict, from the files' tensors."""
        copies = self.copies(sizes)
        memory = {scheme.to_memory(key): tensor for key, tensor in hf_state.items()}
        self._check_copies(memory, copies, scheme)
        if scheme.rules is not None:
            return self._through_file_rules(hf_state, sizes, scheme)
        split = {name: {} for name in self.parts}
        for key, tensor in memory.items():
            if key not in copies and not self.is_kept(key):
                split[self._module_of(key)][key] = tensor
        return {name: part.to_ours(split[name], sizes) for name, part in self.parts.items()}

    def _check_copies(self, memory: dict[str, torch.Tensor], copies: dict[str, str], scheme: KeyScheme) -> None:
        """A tied copy in the files (in-memory names here) must equal its original: never dropped silently."""
        for key, original in copies.items():
            if key in memory and original in memory and not torch.equal(memory[key], memory[original]):
                raise HFMappingError(f"{self.name}: {scheme.to_file(key)} differs from {scheme.to_file(original)}, "
                                     f"which the config ties it to; untie it in config.json or make them equal")

    def to_hf(self, states: dict[str, dict[str, torch.Tensor]], sizes: ModelSizes,
              scheme: KeyScheme = TRANSFORMERS) -> dict[str, torch.Tensor]:
        """The files' tensors (in `scheme`'s names) of every module's full state dict."""
        out = {}
        for name, part in self.parts.items():
            if scheme.rules is not None:
                out.update(apply_rules(scheme.rules(sizes)[name], states[name], to_hf=True, ignored=part.ours_only))
            else:
                out.update({scheme.to_file(k): t for k, t in part.to_hf(states[name], sizes).items()})
        return out

    def _through_file_rules(self, hf_state: dict[str, torch.Tensor], sizes: ModelSizes,
                            scheme: KeyScheme) -> dict[str, dict[str, torch.Tensor]]:
        """to_ours with `scheme`'s own rules: each module reads the files' tensors its rules name."""
        copies = {scheme.to_file(key) for key in self.copies(sizes)}
        rules = scheme.rules(sizes)
        out = {}
        for name in self.parts:
            mine = {n for rule in rules[name] for n in rule.hf}
            state = {k: t for k, t in hf_state.items() if k in mine}
            out[name] = apply_rules(rules[name], state, to_hf=False)
        read = {n for module in rules.values() for rule in module for n in rule.hf}
        unread = sorted(k for k in set(hf_state) - copies - read if not self.is_kept(scheme.to_memory(k)))
        if unread:
            raise HFMappingError(f"{self.name}: tensor {unread[0]} has no counterpart in our modules")
        return out

    # ---- model and data ------------------------------------------------------------------------
    def build_vision(self, sizes: ModelSizes, tp: int, pgs, dtype: torch.dtype = torch.float32,
                     whole: bool = False, **config_overrides):
        """This rank's vision encoder (a stage of the module, see models/vlm.py's builders); its
        forward(items, grids) returns the rows of its items, item by item."""
        return _call(self.vision_builder, sizes, tp, pgs, dtype, whole=whole, **config_overrides)

    def build_audio(self, sizes: ModelSizes, tp: int, pgs, dtype: torch.dtype = torch.float32,
                    whole: bool = False, **config_overrides):
        """This rank's audio encoder; its forward(features, grids) returns the rows of its audios."""
        if not self.audio_builder:
            raise ValueError(f"{self.name} has no audio encoder; remove the audio module from the layout")
        return _call(self.audio_builder, sizes, tp, pgs, dtype, whole=whole, **config_overrides)

    def media(self, sizes: ModelSizes, settings: dict, hf_config: dict):
        """The data's image processing (data/media.py's ImageProcessing) with the image processor
        `settings` of model.json and the model's Hugging Face config (its image token ids)."""
        return _call(self.media_builder, sizes, settings, hf_config)

    def processor_settings(self, model_dir: str, config) -> dict:
        """The image processor's settings (JSON) of a model directory, checked against the model."""
        return _call(self.settings_reader, model_dir, config)
