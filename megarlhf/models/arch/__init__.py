"""HF architectures we convert to and from; importing this package registers all of them.

To add an architecture, write one module next to `llama.py` that calls `register` and import it
below.
"""

from megarlhf.models.arch import llama, mistral, qwen2, qwen3  # noqa: F401  (registration)
from megarlhf.models.arch.registry import (
    Architecture,
    TensorRule,
    architecture,
    architecture_for_hf_class,
    architecture_for_hf_config,
    architecture_for_model,
    architecture_names,
    register,
    supported_hf_classes,
)

__all__ = ["Architecture", "TensorRule", "architecture", "architecture_for_hf_class",
           "architecture_for_hf_config", "architecture_for_model", "architecture_names", "register", "supported_hf_classes"]
