from setuptools import find_packages, setup

setup(
    name="mixln-megatron",
    version="0.1.0",
    description="Mix-LN (Post-LN in the first layers, Pre-LN after) as a Megatron-LM / megatron-core plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=["License :: OSI Approved :: Apache Software License"],
    python_requires=">=3.12",
    packages=find_packages(include=["mixln_megatron", "mixln_megatron.*"]),
    include_package_data=True,
    package_data={"mixln_megatron": ["assets/**/*", "hf/*.py"]},
    install_requires=[
        "megatron-core>=0.17,<0.21",
        # <2.15: megatron-core's torch_dist metadata reader fails on torch 2.15's metadata (compat.py, T).
        "torch>=2.4,<2.15",
        "psutil",  # megatron's dist_checkpointing save needs it but does not declare it
        "tqdm",
    ],
    extras_require={
        # NVIDIA apex is optional and never comes from PyPI (PyPI's `apex` is an unrelated package).
        # TransformerEngine: the release the te tests run (scripts/install_te.sh).
        "te": ["transformer-engine[pytorch]==2.20.2"],
        # Megatron-Bridge (HF <-> Megatron with Bridge's AutoBridge; mixln_megatron.bridge). 0.6.2 is
        # the release tested (scripts/install_bridge.sh); it pins transformers <=5.12.1 itself.
        "bridge": ["megatron-bridge==0.6.2"],
        "hf": ["transformers>=4.56,<6", "safetensors>=0.4"],
        "data": ["nltk>=3.9", "tokenizers>=0.15"],
        "analysis": ["matplotlib>=3.7"],
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.5",  # make test: two workers, one file each (module fixtures built once)
            "transformers>=4.56,<6",
            "safetensors>=0.4",
            "nltk>=3.9",
            "tokenizers>=0.15",
            "matplotlib>=3.7",
            "wandb==0.31.0",  # tests/test_wandb_offline.py reads its offline run files back
            "einops",  # megatron's parallel state with several distributed-optimizer instances (test_scale_hooks)
        ],
    },
    entry_points={"console_scripts": ["mixln-megatron=mixln_megatron.cli:main"]},
)
