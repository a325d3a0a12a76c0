"""megatron-core, as megarlhf uses it: which versions, and what it needs from us.

1. CPU stand-ins. megatron-core assumes CUDA in many places: `torch.cuda.current_device()`
   used as a device, literal `device="cuda"` / `.cuda()`, CUDA events, streams and
   synchronisation, the CUDA RNG tracker, and `Tensor.type()` compared with
   `"torch.cuda.FloatTensor"`. On a machine without a GPU (CI, laptops) `apply_cpu_compat()`
   redirects exactly those to the CPU. It is applied only when CUDA is unavailable, is
   idempotent, and touches nothing on a GPU machine. Rewrites of device arguments and
   `Tensor.type()` answers are confined to calls made from megatron-core's own modules, so our
   code and PyTorch's keep their ordinary behaviour. With `MEGARLHF_TRACE_COMPAT=1` (or
   `apply_cpu_compat(trace=True)`) every redirected megatron-core call site is recorded;
   `traced_sites()` lists them as "file:line what".
2. `torch_adam_load_fixes`: its distributed optimizer's load over torch's Adam.
   `bind_missing_te_names`: its MoE router without Transformer Engine.
   `aux_loss_split_factor`: its load-balancing loss's weight when a sequence is split.
   `load_dist_checkpoint`: its dist-checkpoint load through torch's current DCP call.
   `save_dist_checkpoint`: its synchronous dist-checkpoint save without a spawned manager.
   `moe_routers`, `attach_replay_slot`, `replay_slot`: its routers' per-router top-k replay
   interface, which routing replay (models/routing_replay.py) fills.
3. `PostprocessHook`: a GPTModel subclass replaces the LM head through the private method
   GPTModel.forward ends with.

Written for and tested on megatron-core 0.16.1 through 0.19.2; importing this module with any
other version installed fails with one line saying so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading

import torch
from megatron.core import package_info
from packaging.version import Version

from megarlhf.compat import require

SUPPORTED = ">=0.16.1,<0.20"
VERSION = require("megatron-core", package_info.__version__, SUPPORTED,
                  install='pip install "megatron-core>=0.16.1,<0.20"')

# The directory holding the `megatron` package: sites are recorded relative to it.
_INSTALLED_AT = os.path.dirname(os.path.dirname(os.path.dirname(package_info.__file__)))
_APPLIED = False
_TRACE = False
_SITES: set[str] = set()
_LOCK = threading.Lock()

# Factory functions that take a `device=` keyword and are called with "cuda" by megatron-core.
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "empty_strided",
)


def traced_sites() -> list[str]:
    """Every megatron-core call site redirected so far (empty unless tracing is on)."""
    with _LOCK:
        return sorted(_SITES)


def _megatron_caller(depth: int = 2):
    """The calling frame if it belongs to megatron-core, else None."""
    frame = sys._getframe(depth)
    if frame.f_globals.get("__name__", "").startswith("megatron."):
        return frame
    return None


def _record(frame, what: str) -> None:
    if _TRACE and frame is not None:
        site = f"{os.path.relpath(frame.f_code.co_filename, _INSTALLED_AT)}:{frame.f_lineno} {what}"
        with _LOCK:
            _SITES.add(site)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An int device index means a CUDA ordinal to megatron-core.
    return isinstance(device, int) and not isinstance(device, bool)


def _wrap_factory(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        frame = _megatron_caller()
        if frame is not None:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
                _record(frame, f"torch.{name}(device=cuda)")
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
                _record(frame, f"torch.{name}(pin_memory=True)")
        return fn(*args, **kwargs)

    return wrapper


def _tensor_cuda(self, *args, **kwargs):
    _record(_megatron_caller(), "Tensor.cuda()")
    return self


def _module_cuda(self, *args, **kwargs):
    _record(_megatron_caller(), "Module.cuda()")
    return self


def _wrap_tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        frame = _megatron_caller()
        if frame is not None:
            if args and _is_cuda(args[0]):
                args = ("cpu",) + args[1:]
                _record(frame, "Tensor.to(cuda)")
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
                _record(frame, "Tensor.to(device=cuda)")
        return orig(self, *args, **kwargs)

    return to


def _wrap_tensor_type(orig):
    # megatron-core checks `param.type() == 'torch.cuda.FloatTensor'` to choose optimizer
    # paths; answer with the CUDA spelling for its callers only.
    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str):
            frame = _megatron_caller()
            if frame is not None and result.startswith("torch.") and ".cuda." not in result:
                _record(frame, "Tensor.type()")
                return "torch.cuda." + result[len("torch."):]
        return result

    return type_


class _Event:
    """Stand-in for torch.cuda.Event: records wall time so elapsed_time still works."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, *args, **kwargs):
        import time

        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return (end._t - self._t) * 1000.0


class _Stream:
    """Stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()


def _current_device():
    _record(_megatron_caller(), "torch.cuda.current_device()")
    return "cpu"


def _patch_rng_tracker() -> None:
    # The tracker keeps named CUDA generator states (dropout inside TP regions). On CPU the
    # same bookkeeping over the CPU generator gives the same semantics: fork() swaps a named
    # state in and restores the default one afterwards.
    from megatron.core.tensor_parallel import random as mrandom

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._set_cuda_rng_state = set_state
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

    # fork() warns when the CPU generator moved inside a CUDA-RNG region; here the two are one
    # generator, so the warning would fire on every dropout and means nothing.
    class _DropForkWarning(logging.Filter):
        def filter(self, record):
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())


def apply_cpu_compat(trace: bool | None = None) -> bool:
    """Redirect megatron-core's CUDA assumptions to the CPU. Returns True if applied.

    Does nothing when CUDA is available. Safe to call more than once; `trace` may be switched
    on by a later call.
    """
    global _APPLIED, _TRACE
    if trace is None:
        trace = os.environ.get("MEGARLHF_TRACE_COMPAT", "") not in ("", "0")
    _TRACE = _TRACE or trace
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # `with torch.device(...)` recognises factory functions by identity through a cached set;
    # build that set from the originals first, or the wrappers below would make every
    # `torch.device("meta")` context (ours, and transformers' model loading) silently create
    # real, uninitialised CPU tensors.
    import torch.utils._device as device_context

    device_context._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name), name))
    torch.Tensor.cuda = _tensor_cuda
    torch.nn.Module.cuda = _module_cuda
    torch.Tensor.to = _wrap_tensor_to(torch.Tensor.to)
    torch.Tensor.type = _wrap_tensor_type(torch.Tensor.type)
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Event = _Event
    torch.cuda.Stream = _Stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.default_stream = lambda *a, **k: _Stream()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # The "CUDA" generator is the CPU one here, so seeding it seeds the CPU generator.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.empty_cache = lambda: None
    _patch_rng_tracker()
    _APPLIED = True
    return True


def aux_loss_split_factor(ranks_splitting_a_sequence: int) -> int:
    """What the MoE load-balancing loss coefficient must be multiplied by for the loss to
    weigh the same at every layout. With per-token losses megatron-core weights each rank's
    share of that loss by the tokens the rank holds; when sequence parallelism or CP splits a
    sequence over N ranks, 0.16-0.18 forget the factor N (the summed gradient is 1/N of the
    unsplit one: measured at TP2+SP and CP2), 0.19 multiplies by the TP x CP group's size
    itself. Told apart by what the router does (`_router_scales_by_split_group`), not by its
    version or source text, so a release that changes it is caught either way."""
    return 1 if _router_scales_by_split_group() else ranks_splitting_a_sequence


@functools.cache
def _router_scales_by_split_group() -> bool:
    """Whether the router's load-balancing loss gradient grows with the size of the group
    that splits a sequence: its attach_and_log_load_balancing_loss is run on a stand-in
    router (per-token losses, one token, no logging: layer number None) with groups of size
    1 and 2, and the gradient reaching the loss compared. Ratio 2: it scales by the group;
    1: it does not; anything else, or a stand-in it cannot run on, is a version megarlhf
    does not know (one line)."""
    import types

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    def loss_gradient(group_size: int) -> float:
        router = types.SimpleNamespace(
            config=types.SimpleNamespace(num_layers=1, mtp_num_layers=None,
                                         mtp_use_repeated_layer=False),
            layer_number=None, is_mtp_layer=False, calculate_per_token_loss=True,
            tp_cp_group=types.SimpleNamespace(size=lambda: group_size))
        aux_loss = torch.ones((), requires_grad=True)
        out = TopKRouter.attach_and_log_load_balancing_loss(
            router, torch.zeros(1, 1, requires_grad=True), 1.0, aux_loss, "probe", None,
            valid_token_count=1)
        out.sum().backward()
        return aux_loss.grad.item()

    # The backward reads (and, when unset, sets) the class-wide loss scale training uses.
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(())
    try:
        ratio = loss_gradient(2) / loss_gradient(1)
    except (AttributeError, TypeError) as e:
        ratio = e
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
    if ratio not in (1.0, 2.0):
        raise RuntimeError(f"megatron-core {VERSION}: cannot tell how its MoE router weights "
                           f"the load-balancing loss ({ratio!r}); megarlhf supports "
                           f"{SUPPORTED}")
    return ratio == 2.0


def moe_routers(chunk: torch.nn.Module) -> list[tuple[int, object | None]]:
    """(global layer number, its MoE router, or None for a dense layer) of every transformer
    layer in a model chunk: where routing replay attaches."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out = []
    for layer in chunk.modules():
        if isinstance(layer, TransformerLayer):
            router = getattr(layer.mlp, "router", None)
            out.append((layer.layer_number, router if isinstance(router, TopKRouter) else None))
    return out


def attach_replay_slot(router, slot) -> None:
    """Make `slot` the router's replay interface. Every routing then asks the router's
    `router_replay` for its top-k: `slot.get_replay_topk(scores, topk, num_groups,
    group_topk, default_compute_topk)` returns (probs, indices), where the default computes
    the router's own choice. It is skipped by the fused router (moe_router_fusion), so that is
    refused here. megatron-core's own switch (`moe_enable_routing_replay`) registers every
    router of a process in one class-level list instead, which colocated models would share."""
    if router.config.moe_router_fusion:
        raise ValueError("routing replay with moe_router_fusion: the fused router does not "
                         "consult the replay slot")
    router.router_replay = slot


def replay_slot(router):
    """The router's replay interface (None unless one was attached)."""
    return router.router_replay


def bind_missing_te_names() -> None:
    """megatron-core's MoE router gating reads `te_general_gemm`, a name bound only when
    Transformer Engine imports (0.16.1: NameError in every MoE forward without TE); bound to
    None it takes its own torch matmul path. Any device; idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def with_mlp_submodules(mlp, **linears):
    """A dense layer's MLP spec with some of its submodules (linear_fc1, linear_fc2)
    replaced: megatron-core 0.16 gives the MLP as a ModuleSpec, 0.19 as a functools.partial
    of MLP.as_mlp_submodule with the submodules as a keyword."""
    import dataclasses

    if isinstance(mlp, functools.partial):
        keywords = {**mlp.keywords,
                    "submodules": dataclasses.replace(mlp.keywords["submodules"], **linears)}
        return functools.partial(mlp.func, *mlp.args, **keywords)
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **linears))


def recomputing() -> bool:
    """Whether this forward is megatron-core's full recomputation of a layer in the backward
    pass (its first pass runs checkpointing without gradients, the replay with them)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing() and torch.is_grad_enabled()


def first_pass_of_recomputed() -> bool:
    """Whether this forward is the first (no-gradient) pass of a recomputed layer."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing() and not torch.is_grad_enabled()


def load_dist_checkpoint(sharded_state_dict: dict, path: str) -> dict:
    """megatron-core's `dist_checkpointing.load(sharded_state_dict, path)`.

    0.16 and 0.17 read the torch_dist files with torch's `dcp.load_state_dict`, deprecated
    for `dcp.load` (a FutureWarning at every load, on every rank); 0.18 and later call
    `dcp.load` themselves. For the older ones the load sees, in place of their module's
    `dcp`, one whose `load_state_dict` calls `load` with the same reader, planner, process
    group and coordinator: the same load, without the warning."""
    from megatron.core import dist_checkpointing

    if VERSION >= Version("0.18"):
        return dist_checkpointing.load(sharded_state_dict, path)
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    dcp = torch_strategy.checkpoint
    torch_strategy.checkpoint = _CallingLoad(dcp)
    try:
        return dist_checkpointing.load(sharded_state_dict, path)
    finally:
        torch_strategy.checkpoint = dcp


def save_dist_checkpoint(sharded_state_dict: dict, path: str) -> None:
    """megatron-core's `dist_checkpointing.save(sharded_state_dict, path)`, synchronous.

    Its torch_dist writer hands the write results back through a queue that, for saves run
    in another process, lives in a `multiprocessing` manager it spawns at a process's first
    save (module-global `_results_queue`, 0.16.1 through 0.19.2). The spawned interpreter
    imports torch to unpickle the first results: 3-4 s of every rank's first save on a 2-core
    machine (profiled), for a queue a synchronous save puts into and reads back from in this
    same process. An in-process queue does that job."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, path)


class _CallingLoad:
    """torch.distributed.checkpoint `dcp`, its deprecated `load_state_dict` calling `load`."""

    def __init__(self, dcp):
        self._dcp = dcp

    def __getattr__(self, name: str):
        return getattr(self._dcp, name)

    def load_state_dict(self, state_dict: dict, storage_reader, *, planner=None) -> None:
        # The arguments megatron-core 0.16 and 0.17 pass; the old call reset the reader first.
        storage_reader.reset()
        self._dcp.load(state_dict, storage_reader=storage_reader, planner=planner)


@contextlib.contextmanager
def torch_adam_load_fixes(optimizer):
    """Work around two faults of megatron-core (0.16.1 through 0.19.2) loading a distributed
    optimizer over torch's Adam (no Apex/TE).

    1. The load restores Adam's 'step' from the param groups, then copies every key of the
       live per-parameter state from the saved one, which keeps 'step' elsewhere: KeyError.
       Handing the already restored 'step' back in lets the copy go through unchanged.
    2. The restored 'step' is ONE tensor shared by every parameter's state, so each optimizer
       step increments it once per parameter and Adam's bias correction goes wrong from the
       first step after a resume (measured: loss differs at the second resumed step).
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "_set_main_param_and_optimizer_states"):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            state = opt.optimizer.state[main_param]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values() if opt.optimizer is not None else ():
            if "step" in state:
                state["step"] = state["step"].clone()


class PostprocessHook:
    """Mixed into a GPTModel subclass ahead of GPTModel: the decoder's output goes to
    `postprocess(hidden_states)` instead of the LM head and loss. GPTModel.forward ends with
    `self._postprocess(hidden_states=..., <LM-head arguments>)`, a private method; this and
    `LogitPositionsHook` are the only places that rely on it."""

    def _postprocess(self, hidden_states, **_):
        return self.postprocess(hidden_states)

    def postprocess(self, hidden_states):
        raise NotImplementedError


class LogitPositionsHook:
    """Mixed into a GPTModel subclass ahead of GPTModel: while `logit_positions` (sequence
    positions [n], sorted) is set, the LM head runs at those positions only, and the model
    returns logits [b, n, vocab] instead of [b, s, vocab]. The decoder's output is cut before
    megatron-core's `_postprocess` (see PostprocessHook) makes the logits.

    Under sequence parallelism the decoder's output is split over the TP ranks along the
    sequence: it is gathered first (the gather's backward splits the gradient: the output
    layer, told it is not sequence-parallel for the call, all-reduces its input gradient over
    TP itself, as a column-parallel layer does). Multi-token prediction needs every position
    and ignores the cut."""

    logit_positions: torch.Tensor | None = None

    def _postprocess(self, hidden_states, **kwargs):
        positions = self.logit_positions
        if positions is None or not self.post_process or self.config.mtp_num_layers:
            return super()._postprocess(hidden_states=hidden_states, **kwargs)
        layer = self.output_layer
        if not layer.sequence_parallel:
            return super()._postprocess(hidden_states=hidden_states.index_select(0, positions),
                                        **kwargs)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        whole = gather_from_sequence_parallel_region(hidden_states,
                                                     tensor_parallel_output_grad=False,
                                                     group=layer.tp_group)
        layer.sequence_parallel = False
        try:
            return super()._postprocess(hidden_states=whole.index_select(0, positions),
                                        **kwargs)
        finally:
            layer.sequence_parallel = True
