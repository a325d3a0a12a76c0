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

from megarlhf.compat import vllm as shims
from megarlhf.engine.offload import reallocate, release


class WeightSyncExtension:
    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, full tensor) pairs through the model's own loader: each TP rank keeps its
        shard and CPU weights are repacked, as at start-up. Calling the model's `load_weights`
        directly after start fails on CPU (its weights are already repacked); `reload_weights`
        restores the checkpoint-format parameters first. `weights` may be a lazy iterator: it is
        consumed once, so a streamed bucket can be dropped as soon as its layer is loaded."""
        try:
            self.model_runner.reload_weights(weights_iterator=weights)
            shims.refresh_tied(self.model_runner.get_model())
        except BaseException:
            # A reload that stops half-way leaves unfinished layers on the meta device with
            # vLLM's loading hooks still installed, and the next reload trips over them. Finish
            # it: every layer gets real (old, new or partly loaded) weights and the hooks go.
            # The engine refuses to generate until a later update succeeds.
            shims.finish_reload(self.model_runner.get_model(), self.vllm_config.model_config)
            raise

    def effective_embeddings(self) -> dict[str, torch.Tensor]:
        return shims.effective_embeddings(self.model_runner.get_model())

    def output_products(self, probe: torch.Tensor) -> tuple[int, torch.Tensor]:
        return shims.output_products(self.model_runner.get_model(), probe)

    def kv_cache_bytes(self) -> int:
        return sum(s.nbytes() for s in shims.kv_storages(self.model_runner))

    def release_kv_cache(self) -> None:
        """Give the KV cache's memory back (CPU has no vLLM sleep mode). The tensors, and the
        attention layers' views of them, stay valid objects over empty storage."""
        self._released_kv = release(shims.kv_storages(self.model_runner))

    def restore_kv_cache(self) -> None:
        """Allocate the KV cache again, zeroed. Its old contents are gone, which is safe
        because a weight update comes between a sleep and the next generation, and it resets
        the prefix cache (when on): no token's keys are read before they are written. But the CPU attention reads a partly written block whole and masks the
        rest, and fresh memory may hold NaN bit patterns, which survive a mask (measured: NaN
        logprobs after a wake); zeros do not."""
        reallocate(getattr(self, "_released_kv", []), zero=True)
        self._released_kv = []


