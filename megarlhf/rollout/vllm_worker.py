"""Methods mixed into vLLM's worker (its `worker_extension_cls`), called through
`LLM.collective_rpc`; `self` is the worker. They live in a module of their own because vLLM
imports the extension by its qualified name (under spawn, in a fresh interpreter).

Arguments arrive by reference only while the engine runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): in subprocess mode they are serialised, tensors become
lists and a weight iterator cannot be sent at all. `VLLMEngine` always runs in-process.
"""

from __future__ import annotations

from typing import Iterable

import torch


class WeightSyncExtension:
    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, full tensor) pairs through the model's own loader: each TP rank keeps its
        shard and CPU weights are repacked, as at start-up. Calling the model's `load_weights`
        directly after start fails on CPU (its weights are already repacked); `reload_weights`
        restores the checkpoint-format parameters first. `weights` may be a lazy iterator: it is
        consumed once, so a streamed bucket can be dropped as soon as its layer is loaded."""
        try:
            self.model_runner.reload_weights(weights_iterator=weights)
            _refresh_tied(self.model_runner.get_model())
        except BaseException:
            # A reload that stops half-way leaves unfinished layers on the meta device with
            # vLLM's loading hooks still installed, and the next reload trips over them. Finish
            # it: every layer gets real (old, new or partly loaded) weights and the hooks go.
            # The engine refuses to generate until a later update succeeds.
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model_runner.get_model(),
                                      self.vllm_config.model_config)
            raise

    def effective_embeddings(self) -> dict[str, torch.Tensor]:
        """What this rank's engine computes with, read back through its own kernels:
        {"embed_tokens": its vocabulary rows of the input embedding, "lm_head": the output
        projection as its GEMM applies it (the logits of the identity, transposed), both
        without vLLM's vocabulary padding}. A stale prepacked copy (the tied-embedding bug
        `_refresh_tied` fixes) shows here, not in the parameters."""
        model = self.model_runner.get_model()
        embed, head = model.model.embed_tokens, model.lm_head
        out = {}
        for key, layer in (("embed_tokens", embed), ("lm_head", head)):
            shard = layer.shard_indices
            rows = shard.org_vocab_end_index - shard.org_vocab_start_index
            if key == "embed_tokens":
                weight = layer.weight[:rows]
            else:
                eye = torch.eye(layer.weight.shape[1], dtype=layer.weight.dtype)
                weight = layer.quant_method.apply(layer, eye).t()[:rows]
            out[key] = weight.detach().clone()
        out["vocab_start"] = embed.shard_indices.org_vocab_start_index
        return out

    def kv_cache_bytes(self) -> int:
        return sum(s.nbytes() for s in _kv_storages(self.model_runner))

    def release_kv_cache(self) -> None:
        """Give the KV cache's memory back (CPU has no vLLM sleep mode). The tensors, and the
        attention layers' views of them, stay valid objects over empty storage."""
        storages = _kv_storages(self.model_runner)
        self._released_kv = [(s, s.nbytes()) for s in storages]
        for storage, _ in self._released_kv:
            storage.resize_(0)

    def restore_kv_cache(self) -> None:
        """Allocate the KV cache again. Its old contents are gone, which is safe only because
        the engine runs without prefix caching: no block is read before it is written."""
        for storage, nbytes in getattr(self, "_released_kv", []):
            storage.resize_(nbytes)
        self._released_kv = []


def _refresh_tied(model: torch.nn.Module) -> None:
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


def _kv_storages(model_runner) -> list[torch.UntypedStorage]:
    """Each KV cache storage once (layers may share one)."""
    by_ptr = {}
    for tensor in model_runner.kv_caches:
        storage = tensor.untyped_storage()
        by_ptr.setdefault(storage.data_ptr(), storage)
    return list(by_ptr.values())
