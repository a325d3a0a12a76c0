"""Offloading an engine's state (megarlhf/engine/offload.py): every offloaded storage is
released and has a host copy (grads: released, nothing to copy), and everything comes back
bitwise. The PPO runs with offload switched on are in tests/test_ppo.py."""

from __future__ import annotations

import math

import pytest

from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig
from tests import workers


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offload_releases_every_storage_and_restores_it_bitwise(lm_ref, tiny, dtype):
    # DP2: the distributed optimizer shards Adam's state and the master weights.
    out = launch_local(workers.offload_round_trip, 2, lm_ref, tiny, ParallelConfig(), dtype)[0]
    assert all(out["counts"][k] > 0 for k in ("params", "grads", "optimizer"))
    assert out["offloaded_bytes"] == {"params": 0, "grads": 0, "optimizer": 0}
    # Host copies of the weights and optimizer state, byte for byte; grads are dropped.
    assert out["host_bytes"]["params"] == out["storage_bytes"]["params"] > 0
    assert out["host_bytes"]["optimizer"] == out["storage_bytes"]["optimizer"] > 0
    assert out["host_bytes"]["grads"] == 0 < out["storage_bytes"]["grads"]
    if dtype == "bf16":
        # 16-bit weights: the fp32 master weights are the optimizer's, 2x the bf16 bytes.
        assert out["storage_bytes"]["optimizer"] > 2 * out["storage_bytes"]["params"]
    assert out["bitwise"] == {"params": True, "optimizer": True}
    assert out["grads_zero"]
    assert all(math.isfinite(v) for v in out["step_after"])
    assert out["buffers_reused"] and out["bitwise_again"]
