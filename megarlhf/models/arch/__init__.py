"""HF architectures we convert to and from; importing this package registers all of them.

To add an architecture, write one module next to `llama.py` that calls `register` and import it
below.
"""

from megarlhf.models.arch import (  # noqa: F401  (registration)
    llama, mistral, mixtral, qwen2, qwen2_5_vl, qwen3, qwen3_moe,
)
from megarlhf.models.arch.registry import (
    Architecture,
    TensorRule,
    architecture,
    architecture_for_hf_class,
    architecture_for_hf_config,
    architecture_for_model,
    architecture_names,
    hf_shapes,
    layer_major,
    register,
    supported_hf_classes,
)

__all__ = ["Architecture", "TensorRule", "architecture", "architecture_for_hf_class",
           "architecture_for_hf_config", "architecture_for_model", "architecture_names", "hf_shapes", "layer_major", "register", "supported_hf_classes"]
