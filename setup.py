"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron."""

import re

from setuptools import find_packages, setup

# The version's one home is megatron_hetero/__init__.py (read as text: setup runs before any install).
VERSION = re.search(r'__version__ = "([^"]+)"', open("megatron_hetero/__init__.py", encoding="utf-8").read())[1]

setup(
    name="megatron-hetero",
    version=VERSION,
    description="Heterogeneous per-module parallelism (encoders + LLM) as a Megatron-LM extension",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_hetero", "megatron_hetero.*"]),
    package_data={"megatron_hetero.data": ["*.model"], "megatron_hetero.planner": ["calibrations/*.json"],
                  "megatron_hetero.models": ["kernel_checks.json"], "megatron_hetero.families": ["*/presets.json"]},
    # One command for users: megatron-hetero layout|plan|verify|hf|launch|kernels ... (megatron_hetero/cli/main.py).
    entry_points={"console_scripts": ["megatron-hetero = megatron_hetero.cli.main:main"]},
    install_requires=[
        "torch",
        "megatron-core>=0.19,<0.20",
        "einops",
        "sentencepiece",
        "PyYAML",
        "Pillow",
        "numpy",
        "psutil",  # megatron-core's distributed-checkpoint writer needs it
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        # flash-attn-4 (CuTe DSL, compiled at run time: no build step) as the GPU attention where its
        # gradients were checked (models/attention_kernels.py), at the versions checked, with the DSL's
        # CUDA 13 libraries (torch cu130); a new version needs benchmarks/gpu_fa4_check.sh first. quack-kernels
        # also runs our norms and the MLP's GELU GEMMs (models/norm_kernels.py, models/mlp_kernels.py; a new
        # version needs `megatron-hetero kernels check norms` and `mlp` first).
        "fa4": ["flash-attn-4[cu13]==4.0.0b36", "quack-kernels==0.6.5", "nvidia-cutlass-dsl[cu13]==4.8.1"],
        # Hugging Face weights (megatron_hetero/hf): configs through transformers, tensors in safetensors.
        # tqdm: the progress bar of `hf import` and `hf export`.
        "hf": ["transformers>=5", "safetensors", "tqdm"],
        # megatron-energon datasets as --data-path (megatron_hetero/data/energon.py).
        "energon": ["megatron-energon>=7"],
        # Pictures: `megatron-hetero layout show L.yaml --png F`.
        "plot": ["matplotlib"],
        # Megatron's writers (--tensorboard-dir, --wandb-project), which get our per-module metrics too.
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        # Video files in conversation data, decoded by PyAV (FFmpeg bundled; megatron_hetero/data/video.py).
        "media": ["av"],
        # The tests, and ruff (pyproject.toml's settings), which `make test` runs first.
        "test": ["pytest", "hypothesis", "transformers>=5", "safetensors", "tqdm", "megatron-energon>=7", "av", "ruff",
                 "matplotlib", "tensorboard", "wandb"],
    },
)
