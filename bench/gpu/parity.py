"""2. Numerical parity of the GPU path against the CPU path, fp32, one training step.

The same weights (written from one seeded CPU generator after the model is built, so they do
not depend on the device's init or RNG) and the same batch go through a forward (logits) and
one train_step (loss, grad norm before clipping) on CPU with the reference "local" spec, and
on the GPU with "local" and with "sdpa" (what a torch-only GPU trains with). The same again
with LoRA adapters on all seven projections, with dropout (the "+lora" rows: B is seeded
non-zero like every weight, so the adapters change the logits; the masks come from a hash of
each element's index, which must give the same numbers on both devices; the grad norm is the
adapters' alone).

Tolerances, and why: fp32 rounds at 2^-24 ~ 6e-8 relative per operation. CPU (MKL/oneDNN)
and GPU (cuBLAS, SDPA kernels) sum in different orders and block sizes, which through the
tiny preset's 4 layers gives differences of order 1e-6 on logits of order 1; gradients pass
through twice as many operations. TF32 is switched off on the GPU side, since its 10-bit
mantissa alone would move logits by ~1e-3. A real bug (wrong mask, position, RoPE or
dtype) moves logits by >= 1e-2. So: logits max |diff| <= 1e-4, loss relative diff <= 1e-5,
grad norm relative diff <= 1e-4, an order of magnitude from each regime.
"""

from __future__ import annotations

import torch

from bench.gpu.common import ONE_RANK, Row, mesh_here, random_batch
from bench.gpu.plan import Sizes
from megarlhf.models.presets import preset

LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# No "|" in these texts: they go into markdown table cells.
TOLERANCE = (f"logits max abs diff <= {LOGITS_ATOL:g}, loss rel <= {LOSS_RTOL:g}, grad norm rel "
             f"<= {GRAD_NORM_RTOL:g} (fp32 reordering ~1e-6; a real bug >= 1e-2)")


@torch.no_grad()
def _seeded_weights(module: torch.nn.Module) -> None:
    """Init-like values (std 0.02; norms 1 +- 0.1) from a CPU generator, in name order: the
    same numbers on every device and for every spec with the same parameter names."""
    g = torch.Generator().manual_seed(1234)
    for _, p in sorted(module.named_parameters()):
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1 + 0.1 * noise if p.dim() == 1 else 0.02 * noise)


LORA = "+lora"
"""A spec name's suffix: the spec with LoRA adapters (rank 4, all-linear, dropout 0.1)."""


def side(sizes: Sizes, specs: list[str]) -> dict[str, dict]:
    """Per layer spec (with LORA: and adapters): logits, loss and grad norm of one step on
    this process's device."""
    from megarlhf.engine.losses import lm_loss
    from megarlhf.engine.optim import OptimConfig
    from megarlhf.engine.train import TrainEngine
    from megarlhf.models.gpt import model_spec
    from megarlhf.models.lora import LoraConfig

    mesh, on_gpu = mesh_here()
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = preset(sizes.parity_preset)
    batch = random_batch(model.vocab_size, sizes.parity_rows, sizes.parity_seq, seed=1)
    V = model.vocab_size
    out = {}
    for name in specs:
        lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1) if name.endswith(LORA) else None
        spec = model_spec(model, ONE_RANK, dtype=torch.float32,
                          layer_spec=name.removesuffix(LORA), on_gpu=on_gpu, lora=lora)
        engine = TrainEngine(spec, mesh, OptimConfig(lr=1e-3))
        _seeded_weights(engine.unwrapped()[0])
        loss_fn = lm_loss(mesh, V)

        def logits_fn(b, logits_BTV):
            loss_sum, tokens, metrics = loss_fn.closure(b, loss_fn.per_position(b, logits_BTV))
            return loss_sum, tokens, {**metrics, "logits": logits_BTV[..., :V].detach().float()}

        logits = engine.forward([batch], logits_fn)[0]["logits"].cpu()
        step = engine.train_step([batch], loss_fn)
        out[name] = {"logits": logits, "loss": step.loss, "grad_norm": step.grad_norm,
                     "device": str(mesh.device)}
    return out


def compare(ref: dict, other: dict) -> tuple[bool, str]:
    logits = float((ref["logits"] - other["logits"]).abs().max())
    loss = abs(ref["loss"] - other["loss"]) / abs(ref["loss"])
    grad = abs(ref["grad_norm"] - other["grad_norm"]) / abs(ref["grad_norm"])
    ok = logits <= LOGITS_ATOL and loss <= LOSS_RTOL and grad <= GRAD_NORM_RTOL
    return ok, (f"{'PASS' if ok else 'FAIL'}: logits max abs diff {logits:.1e}, loss rel "
                f"{loss:.1e} ({ref['loss']:.5f} vs {other['loss']:.5f}), grad norm rel "
                f"{grad:.1e} ({ref['grad_norm']:.5f} vs {other['grad_norm']:.5f})")


def measure(sizes: Sizes, run) -> list[Row]:
    # The CPU reference runs in a process that cannot see the GPU, so megatron-core takes its
    # CPU code paths exactly as on a machine without one.
    cpu = run(side, sizes, ["local", "local" + LORA], env={"CUDA_VISIBLE_DEVICES": ""})
    gpu = run(side, sizes, ["local", "sdpa", "sdpa" + LORA])
    rows = []
    for name, result in gpu.items():
        reference = "local" + LORA if name.endswith(LORA) else "local"
        setting = (f"{sizes.parity_preset}, {sizes.parity_rows} x {sizes.parity_seq} tokens, "
                   f"fp32, one step; CPU '{reference}' spec vs {result['device']}")
        ok, text = compare(cpu[reference], result)
        rows.append((f"GPU spec {name}", setting, text))
    return rows
