"""megarlhf: Megatron-based 3D-parallel RLHF."""

__version__ = "0.1.0"

import warnings as _warnings

# megatron-core warns at import and on every rank that optional GPU libraries (Transformer
# Engine, Apex) are absent; on CPU that is expected and the warnings bury real output.
for _msg in (r".*Transformer Engine and Apex are not installed.*",
             r".*Apex is not installed.*",
             r".*CUDA_DEVICE_MAX_CONNECTIONS.*"):
    _warnings.filterwarnings("ignore", message=_msg)
