"""megarlhf: Megatron-based 3D-parallel RLHF."""

__version__ = "0.1.0"

from megarlhf.logs import apply as _apply_log_settings

_apply_log_settings()
