"""megarlhf: Megatron-based 3D-parallel RLHF."""

__version__ = "0.1.0"

from megarlhf.compat.warnings import quiet_known_warnings as _quiet_known_warnings

_quiet_known_warnings()
