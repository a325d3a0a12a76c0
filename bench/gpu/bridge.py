"""4. Weight-sync bandwidth of the bridge next to a plain device-to-device copy of the bytes.

Colocated at TP1/PP1 (one GPU): `WeightBridge.stream()` hands out HF-named views of the
parameters, and every tensor is copied into a preallocated destination of its own (views of
one arena, as an engine's in-place load writes its weights). Baselines on the same device, same
byte count: one `copy_` of a flat buffer (the device's copy bandwidth), and a `copy_` per
model parameter into the arena (the same copy cut into as many launches as the model has
tensors). GB/s = HF bytes / time (each byte is read once and written once, so memory traffic
is twice that). Best of N rounds, the three interleaved within a round.
"""

from __future__ import annotations

import torch

from bench.gpu.common import Row, dtype_name, mesh_here, source_chunks, timed
from bench.gpu.plan import Sizes
from megarlhf.models.presets import preset


def sync_rank(sizes: Sizes) -> dict:
    from megarlhf.models.arch import architecture
    from megarlhf.rollout.bridge import WeightBridge

    mesh, on_gpu = mesh_here()
    model = preset(sizes.sync_preset)
    chunks = source_chunks(model, sizes.dtype, mesh, on_gpu)
    bridge = WeightBridge(chunks, mesh, model, architecture("llama"),
                          bucket_bytes=sizes.bucket_bytes)
    slots = [s for b in bridge.plan.buckets for unit in b.slots for s in unit]
    total = sum(s.numel for s in slots)
    arena = torch.zeros(total, dtype=sizes.dtype, device=mesh.device)  # touched up front
    dest, offset = {}, 0
    for s in slots:
        dest[s.name] = arena[offset:offset + s.numel].view(s.shape)
        offset += s.numel
    flat_source = torch.randn(total, device=mesh.device).to(sizes.dtype)
    params = [p.detach().reshape(-1) for chunk in chunks for p in chunk.parameters()]

    @torch.no_grad()
    def bridge_sync():
        for bucket in bridge.stream(reuse_buffer=True):
            for name, tensor in bucket:
                dest[name].copy_(tensor)

    def flat_copy():
        arena.copy_(flat_source)

    def per_parameter_copy():
        # Parameters hold a few more elements than the HF tensors (vocabulary padding rows).
        start = 0
        for p in params:
            n = min(p.numel(), total - start)
            arena[start:start + n].copy_(p[:n])
            start += n

    steps = {"bridge.stream() -> copy_ per HF tensor": bridge_sync,
             "copy_ of one flat buffer": flat_copy,
             "copy_ per parameter": per_parameter_copy}
    times = {name: [] for name in steps}
    for _ in range(sizes.sync_rounds):
        for name, step in steps.items():
            times[name].append(timed(step, mesh.device))
    # Outside the timings: the bridge really moved the model's weights.
    bridge_sync()
    embedding = chunks[0].embedding.word_embeddings.weight[:model.vocab_size]
    verified = torch.equal(dest["model.embed_tokens.weight"], embedding)
    item = torch.empty((), dtype=sizes.dtype).element_size()
    return {"best": {n: min(t) for n, t in times.items()}, "bytes": total * item,
            "buckets": len(bridge.plan.buckets), "tensors": len(slots),
            "parameters": len(params), "verified": verified, "device": str(mesh.device)}


def measure(sizes: Sizes, run) -> list[Row]:
    out = run(sync_rank, sizes)
    gb = out["bytes"] / 1e9
    setting = (f"{sizes.sync_preset}, {dtype_name(sizes.dtype)}, {gb:.3f} GB, "
               f"{out['tensors']} HF tensors / {out['parameters']} parameters, "
               f"{out['buckets']} bucket(s) of <= {sizes.bucket_bytes / 2**20:g} MiB, "
               f"{out['device']}")
    base = out["best"]["copy_ of one flat buffer"]
    rows = []
    for name, t in out["best"].items():
        result = f"{gb / t:,.1f} GB/s ({t * 1e3:.2f} ms, best of {sizes.sync_rounds}; " \
                 f"{base / t:.2f}x the flat copy)"
        if name.startswith("bridge"):
            result += f"; weights verified: {out['verified']}"
        rows.append((name, setting, result))
    return rows
