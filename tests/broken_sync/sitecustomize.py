"""A weight sync that breaks after the first, in one of two ways (MEGARLHF_TEST_BROKEN_SYNC):

- "norm": the stream's final norm arrives scaled by 1.5 (every logit moves), as a mangled
  tensor would;
- "row": the stream arrives intact, but the engine then computes with one vocabulary row of
  its output projection pushed far down (token 7 is never drawn again), as a stale or
  half-loaded copy would.

Every MegatronEngine.update_weights of this process but its first is broken. tests/test_ppo.py
puts this directory on the test process's PYTHONPATH for one run: the launcher then starts a
new server for that run's ranks (megarlhf/parallel/launcher.py), which imports `sitecustomize`
at start-up as every Python process does, so only the ranks of that one run are broken."""

import os

import torch

from megarlhf.rollout import megatron_engine

_update = megatron_engine.MegatronEngine.update_weights
_calls = 0


def _scaled_norm(buckets):
    for bucket in buckets:
        yield [(name, tensor * 1.5 if name == "model.norm.weight" else tensor)
               for name, tensor in bucket]


def update_weights(self, buckets):
    global _calls
    _calls += 1
    if _calls == 1:
        return _update(self, buckets)
    # Read per call: this module is imported once by the rank server, whose forks then take
    # their run's environment.
    if os.environ["MEGARLHF_TEST_BROKEN_SYNC"] == "norm":
        return _update(self, _scaled_norm(buckets))
    _update(self, buckets)
    model = self.model
    weight = model.shared_embedding_or_output_weight() \
        if model.share_embeddings_and_output_weights else model.output_layer.weight
    with torch.no_grad():
        weight[7] = -50 * weight[7].abs()


megatron_engine.MegatronEngine.update_weights = update_weights
