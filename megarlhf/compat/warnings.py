"""Third-party warnings that every run prints, that no user can act on, filtered by their exact
text (a new warning from the same place still shows). Applied by megarlhf/logs.py when
megarlhf is imported, so every command, rank and worker process gets it, unless
MEGARLHF_LIBRARY_LOGS asks to see the libraries' output."""

from __future__ import annotations

import re
import warnings

# (category, the message's start, verbatim; why it is noise).
KNOWN = (
    # megatron-core, at import and on every rank: expected on CPU and without the GPU extras.
    (UserWarning, "Transformer Engine and Apex are not installed."),
    (UserWarning, "Apex is not installed."),
    # megatron-core's TransformerConfig, for the default it sets itself.
    (UserWarning, "full scope is deprecated."),
    (UserWarning, "CUDA_DEVICE_MAX_CONNECTIONS"),
    # megatron-core's linear layers at TP > 1 (on CPU too), once per process: a hint for its
    # own GPU scheduling that names an environment variable, not a megarlhf setting.
    (UserWarning, "When using async grad allreduce it is recommended to set the"),
    (UserWarning, "When using sequence parallelism it is recommended to set the"),
    # megatron-core 0.19, at import.
    (UserWarning, "MimoModelConfig is experimental and still under active development."),
    # torch.distributed.checkpoint, when megatron-core 0.19 calls its load positionally.
    (UserWarning, "The argument order of load has been changed."),
    # torch, for what megatron-core's dist_checkpointing uses internally.
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
    # torch, for the collectives megatron-core's DDP and distributed optimizer call.
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated."),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated."),
    # torch, when vLLM reads the old name of ReduceOp at import.
    (FutureWarning, "`torch.distributed.reduce_op` is deprecated,"),
    # torch, when megatron-core's optimizer reads `.grad` of its non-leaf main parameters.
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed."),
    # megatron-core's config for MoE models: megarlhf refuses to train at TP > 1 without
    # sequence parallelism before launch (forward-only models do not need it), and routes in
    # the model's dtype on purpose (as HF and vLLM do, so trainer and engine pick the same
    # experts).
    (UserWarning, "When using expert parallelism and tensor parallelism for training"),
    (UserWarning, "Using a large number of experts (e.g. >=32) without fp32 routing."),
    # torch.distributed.checkpoint, when a converter reads or writes without a process group:
    # one process is what the converters are designed to be.
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized, assuming the "
                  "intent is to"),
    (UserWarning, "torch.distributed is unavailable or uninitialized, assuming the intent is "
                  "to"),
)


def quiet_known_warnings(quiet: bool = True) -> None:
    """Ignore the known warnings, or (quiet=False) show them as Python's default does: a rank
    forked from a process that ignored them may be asked for the libraries' output."""
    for category, start in KNOWN:
        warnings.filterwarnings("ignore" if quiet else "default", message=re.escape(start),
                                category=category)
