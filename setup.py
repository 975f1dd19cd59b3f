"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron."""

from setuptools import find_packages, setup

setup(
    name="megatron-hetero",
    version="0.1.0",
    description="Heterogeneous per-module parallelism (encoders + LLM) as a Megatron-LM extension",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    # The repository's top-level patches/ installs as megatron_hetero.patches.
    packages=find_packages(include=["megatron_hetero", "megatron_hetero.*"]) + ["megatron_hetero.patches"],
    package_dir={"megatron_hetero.patches": "patches"},
    package_data={"megatron_hetero.data": ["*.model"]},
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
        "flash": ["flash-attn"],
        # Hugging Face weights (megatron_hetero/hf): configs through transformers, tensors in safetensors.
        "hf": ["transformers>=5", "safetensors"],
        # megatron-energon datasets as --data-path (megatron_hetero/data/energon.py).
        "energon": ["megatron-energon>=7"],
        "test": ["pytest", "hypothesis", "transformers>=5", "safetensors", "megatron-energon>=7"],
    },
)
