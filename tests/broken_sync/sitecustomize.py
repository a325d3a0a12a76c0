"""A weight sync that breaks after the first: every MegatronEngine.update_weights of this
process but its first scales the final norm by 1.5 (every logit moves), as a mangled tensor
would. tests/test_ppo.py puts this directory on the ranks' PYTHONPATH, so only the spawned
ranks of that one run import it (Python imports `sitecustomize` at start-up)."""

from megarlhf.rollout import megatron_engine

_update = megatron_engine.MegatronEngine.update_weights
_calls = 0


def _broken(buckets):
    for bucket in buckets:
        yield [(name, tensor * 1.5 if name == "model.norm.weight" else tensor)
               for name, tensor in bucket]


def update_weights(self, buckets):
    global _calls
    _calls += 1
    return _update(self, buckets if _calls == 1 else _broken(buckets))


megatron_engine.MegatronEngine.update_weights = update_weights
