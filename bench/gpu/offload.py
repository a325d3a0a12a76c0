"""6. Offload round trip: a trained engine's weights and Adam state to host memory and back.

What a colocated PPO step pays per phase with offload_params / offload_optimizer on: the
engine of the training preset takes one bf16 step (so Adam's moments and the fp32 master
weights exist), then `Offloader` moves params and optimizer to host memory (pinned on a GPU)
and back, twice: the first offload pins its host buffers, the second reuses them, as every
later phase of a run does. Reported: each direction's GB/s (the offload of both round trips),
the device memory the offload freed as the driver sees it (torch.cuda.mem_get_info, so
allocator caching cannot hide a leak), and whether every byte came back equal.
"""

from __future__ import annotations

import torch

from bench.gpu.common import ONE_RANK, Row, dtype_name, mesh_here, random_batch, timed
from bench.gpu.plan import Sizes
from megarlhf.models.presets import preset

KINDS = ("params", "optimizer")


def _free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()  # the released storages go back to the driver
    return torch.cuda.mem_get_info(device)[0]


def _fingerprint(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().cpu() for t in tensors]


def offload_rank(sizes: Sizes) -> dict:
    from megarlhf.engine.losses import lm_loss
    from megarlhf.engine.offload import Offloader, storages_of
    from megarlhf.engine.optim import OptimConfig
    from megarlhf.engine.schedule import rank_microbatches
    from megarlhf.engine.train import TrainEngine
    from megarlhf.models.gpt import model_spec

    mesh, on_gpu = mesh_here()
    model = preset(sizes.offload_preset)
    spec = model_spec(model, ONE_RANK, dtype=sizes.dtype, layer_spec="sdpa" if on_gpu else "local",
                      on_gpu=on_gpu)
    engine = TrainEngine(spec, mesh, OptimConfig(lr=1e-5))
    batch = random_batch(model.vocab_size, 1, sizes.offload_seq)
    engine.train_step(rank_microbatches(batch, mesh, 1), lm_loss(mesh, model.vocab_size))
    offloader = Offloader(engine)
    before = _fingerprint([t for kind in KINDS for t in offloader.tensors(kind)])
    nbytes = sum(s.nbytes() for s in storages_of(offloader.tensors(k) for k in KINDS).values())
    resident = _free_bytes(mesh.device)
    first_s = timed(lambda: offloader.offload(KINDS), mesh.device)
    freed = _free_bytes(mesh.device) - resident
    offloader.reload(KINDS)
    out_s = timed(lambda: offloader.offload(KINDS), mesh.device)
    back_s = timed(lambda: offloader.reload(KINDS), mesh.device)
    after = [t.cpu() for kind in KINDS for t in offloader.tensors(kind)]
    equal = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    return {"bytes": nbytes, "first_s": first_s, "out_s": out_s, "back_s": back_s,
            "freed": freed, "equal": equal}


def measure(sizes: Sizes, run) -> list[Row]:
    out = run(offload_rank, sizes)
    gb = out["bytes"] / 1e9
    setting = (f"{sizes.offload_preset}, {dtype_name(sizes.dtype)} weights + Adam state "
               f"({gb:.2f} GB), one rank")
    freed = (f"{out['freed'] / 1e9:.2f} GB freed on the device (mem_get_info)"
             if out["freed"] else "no device memory to free (CPU)")
    result = (f"to host {gb / out['first_s']:.1f} GB/s the first time (pinning, "
              f"{out['first_s']:.3f} s), {gb / out['out_s']:.1f} GB/s after "
              f"({out['out_s']:.3f} s), back "
              f"{gb / out['back_s']:.1f} GB/s ({out['back_s']:.3f} s); {freed}; bytes equal "
              f"after the round trip: {out['equal']}")
    return [("", setting, result)]
