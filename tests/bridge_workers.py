"""Per-rank functions for the resharding-bridge tests (importable, so `spawn` can run them)."""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.engine.checkpoint import checkpoint_architecture, engine_from_checkpoint, read_meta
from megarlhf.engine.train import TrainEngine
from megarlhf.models.arch import architecture
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.parallel.mesh import DistEnv, ParallelConfig, init_mesh
from megarlhf.rollout.bridge import WeightBridge, open_channel, receive
from tests.live_bytes import LiveBytes


def _bridge(ckpt: str, parallel: ParallelConfig, env: DistEnv | None = None, **kwargs):
    mesh = init_mesh(parallel, env)
    engine = engine_from_checkpoint(ckpt, parallel, mesh, on_gpu=False)
    return WeightBridge(engine.chunks, mesh, engine.spec.model,
                        checkpoint_architecture(read_meta(ckpt)), **kwargs), mesh


def _collect(stream) -> tuple[dict[str, torch.Tensor], list[int]]:
    tensors, bucket_bytes = {}, []
    for bucket in stream:
        bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for name, tensor in bucket:
            assert name not in tensors, f"{name} streamed twice"
            tensors[name] = tensor.clone()
    return tensors, bucket_bytes


def colocated(ckpts: list[str], parallel: ParallelConfig, bucket_bytes: int, dtype=None,
              reuse_buffer: bool = False):
    """Per checkpoint, this rank's stream (twice, so a reused buffer is reused across syncs):
    ({HF name: tensor}, bytes of each bucket)."""
    out = []
    for ckpt in ckpts:
        bridge = _bridge(ckpt, parallel, bucket_bytes=bucket_bytes, dtype=dtype)[0]
        _collect(bridge.stream(reuse_buffer=reuse_buffer))
        out.append(_collect(bridge.stream(reuse_buffer=reuse_buffer)))
    return out


def refusals(cases: dict[str, tuple[str, dict]]) -> dict[str, str]:
    """Per case (checkpoint, config fields that the bridge is told but the model lacks): the
    bridge's error message."""
    messages = {}
    for case, (ckpt, claimed) in cases.items():
        mesh = init_mesh(ParallelConfig())
        meta = read_meta(ckpt)
        model = ModelConfig.from_dict(meta["model"])
        engine = TrainEngine(model_spec(model, ParallelConfig(), value_head=meta["value_head"],
                                        on_gpu=False), mesh)
        try:
            WeightBridge(engine.chunks, mesh, dataclasses.replace(model, **claimed),
                         architecture("llama"))
        except ValueError as e:
            messages[case] = str(e)
    return messages


def disaggregated(ckpt: str, parallel: ParallelConfig, train_world: int, train_port: int,
                  channel_port: int, bucket_bytes: int):
    """Ranks below `train_world` train and send; the others are engine processes."""
    import os

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    receivers = world - train_world
    size = parallel.pipeline_parallel + receivers
    if rank >= train_world:
        channel = open_channel("127.0.0.1", channel_port, parallel.pipeline_parallel
                               + rank - train_world, size)
        return _collect(receive(channel))
    env = DistEnv(rank=rank, world_size=train_world, local_rank=rank,
                  master_addr="127.0.0.1", master_port=train_port)
    bridge, mesh = _bridge(ckpt, parallel, env, bucket_bytes=bucket_bytes)
    channel = None
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        channel = open_channel("127.0.0.1", channel_port, mesh.pp_rank, size)
    bridge.send(channel)
    return None


def stream_peak_bytes(ckpt: str, parallel: ParallelConfig, bucket_bytes: int):
    """(peak bytes of tensors alive at once while streaming, the plan's bound, model bytes).

    The consumer drops each bucket before asking for the next, as an engine does once it has
    loaded it.
    """
    bridge, _ = _bridge(ckpt, parallel, bucket_bytes=bucket_bytes)
    checksum = torch.zeros((), dtype=torch.float64)
    with LiveBytes() as live:
        for bucket in bridge.stream(reuse_buffer=True):
            for _, tensor in bucket:
                checksum.add_(tensor.sum())
            del bucket, tensor
    model_bytes = sum(b.numel for b in bridge.plan.buckets) * 4
    return live.peak, bridge.plan.peak_extra_bytes, model_bytes
