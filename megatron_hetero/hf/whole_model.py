"""Whole Hugging Face VLM directories (a family of megatron_hetero/families: config.json's model_type
says which) <-> Megatron checkpoints of our `vision` and `llm` modules:

    python -m megatron_hetero.hf import --model HF_DIR --save CKPT
    python -m megatron_hetero.hf export --load CKPT --out HF_DIR [--model-sizes CKPT_OF_THE_IMPORT/model.json]

The import reads every *.safetensors shard in either key spelling the family knows (the Hub's files
or transformers 5's names), maps every tensor (one without a counterpart stops it: nothing is
dropped), writes a release checkpoint any layout loads, and `model.json`: the family, every module's
sizes, the image processor's settings, the Hugging Face config (and config.json's text), the key
spelling and dtypes of the files, and the directory's other files (tokenizer, chat template,
processor), copied beside the checkpoint. The export writes config.json, model.safetensors (the
imported spelling and dtypes: bit-identical to the import's files without training) and those files.
"""

import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_hetero.convert.progress import Progress, quiet, read_safetensors, state_bytes
from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.families import UnknownFamilyError, family_named, family_of_config
from megatron_hetero.hf.checkpoint import MODEL_FILE, read_description, read_states, write_release
from megatron_hetero.spec.sizes import sizes_from_dict, sizes_to_dict

FILES_DIR = "hf_files"  # beside the import's checkpoint: the model directory's other files
KEPT_FILE = "hf_kept.safetensors"  # beside it too: the tensors no module holds (VLMFamily.kept)
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
CONFIG = "config.json"


def _read_tensors(model_dir: Path, progress: Progress) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise HFMappingError(f"{model_dir} holds no *.safetensors file; save the model with save_pretrained "
                             f"(safetensors is its default)")
    return read_safetensors(files, progress)


def _dtypes(tensors: dict[str, torch.Tensor]) -> dict:
    """The files' dtypes: the most common one, and the tensors of another."""
    names = {key: str(t.dtype).removeprefix("torch.") for key, t in tensors.items()}
    common = Counter(names.values()).most_common(1)[0][0]
    return dict(default=common, other={key: d for key, d in names.items() if d != common})


def _copy_files(model_dir: Path, save: Path) -> dict:
    """The model directory's files but config.json and the weights, copied to save/FILES_DIR."""
    names = sorted(p.name for p in model_dir.iterdir()
                   if p.is_file() and p.name != CONFIG and not p.name.endswith(WEIGHT_SUFFIXES))
    target = save / FILES_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2(model_dir / name, target / name)
    return dict(dir=str(target.resolve()), names=names)


def _config(model_dir: Path):
    """(family, transformers config) of a model directory: the family from config.json's model_type
    first (a config of another model may not even build under transformers' classes)."""
    from transformers import AutoConfig

    if not (model_dir / CONFIG).is_file():
        raise HFMappingError(f"--model {model_dir} holds no {CONFIG}; give a Hugging Face model directory")
    try:
        family = family_of_config(SimpleNamespace(**json.loads((model_dir / CONFIG).read_text())))
        return family, AutoConfig.from_pretrained(model_dir)
    except UnknownFamilyError as error:
        raise HFMappingError(str(error)) from None
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as error:
        raise HFMappingError(f"{model_dir / CONFIG}: not a config transformers reads ({error})") from None


def import_model(model_dir: str, save: str, progress: Progress | None = None) -> Path:
    """Write `save`/release, its tracker and model.json from a whole VLM's Hugging Face directory."""
    model_dir, save_dir = Path(model_dir), Path(save)
    family, config = _config(model_dir)
    sizes = family.sizes(config)
    tensors = _read_tensors(model_dir, progress or quiet())
    scheme = family.scheme_of(tensors, sizes)
    states = family.to_ours(tensors, sizes, scheme)
    if (save_dir / "release").exists():
        raise HFMappingError(f"{save_dir / 'release'} exists; choose another --save directory")
    kept = _save_kept(family.kept_tensors(tensors, scheme), save_dir)
    description = dict(
        sizes=sizes_to_dict(sizes), family=family.name,
        hf=dict(model_type=config.model_type, config=config.to_dict(), config_json=(model_dir / CONFIG).read_text(),
                scheme=scheme.name, dtypes=_dtypes(tensors),
                copies=sorted(key for key in family.copies(sizes) if scheme.to_file(key) in tensors), kept=kept),
        processor=family.processor_settings(str(model_dir), config), files=_copy_files(model_dir, save_dir))
    (save_dir / MODEL_FILE).write_text(json.dumps(description, indent=1))
    write_release(save_dir, sizes, states, {name: () for name in states}, progress or quiet())
    return save_dir


def _save_kept(tensors: dict[str, torch.Tensor], save_dir: Path) -> str | None:
    """The kept tensors written beside the checkpoint: the file's absolute path (None: none)."""
    from safetensors.torch import save_file

    if not tensors:
        return None
    save_dir.mkdir(parents=True, exist_ok=True)
    save_file({key: t.contiguous() for key, t in tensors.items()}, save_dir / KEPT_FILE)
    return str((save_dir / KEPT_FILE).resolve())


def _read_kept(hf: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = hf.get("kept")
    if path is None:
        return {}
    if not Path(path).is_file():
        raise HFMappingError(f"{path} (the imported tensors no module trains, kept beside its checkpoint) is "
                             f"missing; import the model again")
    return load_file(path)


def _scheme(family, name: str):
    return next(scheme for scheme in family.schemes if scheme.name == name)


def export_model(load: str, out: str, model_file: str | None = None, progress: Progress | None = None) -> Path:
    """A Hugging Face directory of the whole model in checkpoint `load` (imported or trained, any layout)."""
    from safetensors.torch import save_file

    progress = progress or quiet()
    description, _ = read_description(load, model_file)
    if "family" not in description:
        raise HFMappingError(f"--load {load} holds no whole-model import; export its modules with --vision-out "
                             f"and --llm-out")
    family, sizes, hf = family_named(description["family"]), sizes_from_dict(description["sizes"]), description["hf"]
    states = read_states(load, sizes, progress)
    scheme = _scheme(family, hf["scheme"])
    tensors = family.to_hf(states, sizes, scheme)
    copies = family.copies(sizes)
    tensors.update({scheme.to_file(key): tensors[scheme.to_file(copies[key])].clone() for key in hf["copies"]})
    tensors.update(_read_kept(hf))
    progress.expect(state_bytes(tensors) - state_bytes(states))  # the copies (tied weights), kept tensors
    dtypes = hf["dtypes"]
    tensors = {key: t.to(getattr(torch, dtypes["other"].get(key, dtypes["default"]))).contiguous()
               for key, t in progress.tensors(tensors.items())}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with progress.stage("writing model.safetensors", state_bytes(states), expected=True):
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(hf["config_json"])
    files = description["files"]
    for name in files["names"]:
        source = Path(files["dir"], name)
        if not source.is_file():
            raise HFMappingError(f"{source} (a file of the imported model directory, kept beside its checkpoint) "
                                 f"is missing; copy it into {out_dir} yourself")
        shutil.copy2(source, out_dir / name)
    return out_dir
