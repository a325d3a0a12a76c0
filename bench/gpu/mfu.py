"""1. Training throughput and MFU: bf16 training steps of a preset through TrainEngine.

Model FLOPs per trained token (the PaLM / Megatron convention, so numbers compare with
published MFU):

    6 * N  +  12 * L * (heads * head_dim) * S

N = weights that take part in a matmul: per layer the Q, K, V, O projections and the three
SwiGLU matrices, plus the LM head (V x h; counted even when tied to the embedding, because its
matmul is real; the input embedding is a lookup and is not counted; norms are negligible).
6 = 2 (multiply-add) x 3 (forward, and backward for inputs and for weights). The second term
is attention's score and value matmuls (Q K^T and P V: 2 x 2 x S x heads x head_dim per token
and layer, x 3 for forward + backward), counted over the full S x S square as PaLM does, not
halved for the causal mask. MFU = achieved model FLOPs/s / the GPU's peak dense bf16 FLOPs.
"""

from __future__ import annotations

from bench.gpu.common import (
    ONE_RANK, Row, dtype_name, gpu_memory_gib, median, mesh_here, params_label, random_batch,
    timed,
)
from bench.gpu.plan import Sizes
from megarlhf.models.config import ModelConfig
from megarlhf.models.presets import preset

FORMULA = "model FLOPs/token = 6*N + 12*L*(heads*head_dim)*S (PaLM convention, N = matmul weights)"

# Peak dense (no sparsity) bf16 tensor-core TFLOPs from NVIDIA's datasheets, matched against
# torch.cuda.get_device_name() in this order (the first substring found wins).
PEAK_BF16_TFLOPS = (
    ("H200", 989.0, "H200 bf16 dense"),
    ("H100 PCIe", 756.0, "H100 PCIe bf16 dense"),
    ("H100 NVL", 835.0, "H100 NVL bf16 dense"),
    ("H100", 989.0, "H100 SXM bf16 dense"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("A100", 312.0, "A100 bf16 dense"),
)


def matmul_params(model: ModelConfig) -> int:
    h, d = model.hidden_size, model.kv_channels
    attention = h * d * (2 * model.num_attention_heads + 2 * model.kv_heads)  # Q, O; K, V
    mlp = 3 * h * model.ffn_hidden_size  # gate, up, down
    return model.num_layers * (attention + mlp) + model.vocab_size * h  # + LM head


def train_flops_per_token(model: ModelConfig, seq: int) -> int:
    attention = 12 * model.num_layers * model.num_attention_heads * model.kv_channels * seq
    return 6 * matmul_params(model) + attention


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float) -> float:
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)


def peak_for(gpu_name: str | None) -> tuple[float, str] | None:
    """(peak TFLOPs, what it is) of a known GPU, else None."""
    for key, tflops, label in PEAK_BF16_TFLOPS:
        if gpu_name and key in gpu_name:
            return tflops, label
    return None


def train_rank(sizes: Sizes, layer_spec: str) -> dict:
    """Per-step time of `layer_spec` training steps on this process's device."""
    from megarlhf.engine.losses import lm_loss
    from megarlhf.engine.optim import OptimConfig
    from megarlhf.engine.schedule import rank_microbatches
    from megarlhf.engine.train import TrainEngine
    from megarlhf.models.gpt import model_spec

    mesh, on_gpu = mesh_here()
    if layer_spec == "te":
        try:  # installed is not the same as importable (a wheel for another CUDA or torch)
            import transformer_engine.pytorch  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure is a skip, not a crash
            return {"skipped": f"transformer_engine failed to import: {type(e).__name__}: {e}"}
    model = preset(sizes.train_preset)
    spec = model_spec(model, ONE_RANK, dtype=sizes.dtype, layer_spec=layer_spec, on_gpu=on_gpu)
    engine = TrainEngine(spec, mesh, OptimConfig(lr=1e-5))
    loss_fn = lm_loss(mesh, model.vocab_size)
    rows = sizes.micro_batch * sizes.microbatches
    batch = random_batch(model.vocab_size, rows, sizes.train_seq)
    microbatches = rank_microbatches(batch, mesh, sizes.microbatches)
    for _ in range(sizes.warmup_steps):  # kernel autotuning, allocator growth
        engine.train_step(microbatches, loss_fn)
    metrics = []
    times = [timed(lambda: metrics.append(engine.train_step(microbatches, loss_fn)), mesh.device)
             for _ in range(sizes.steps)]
    return {"step_s": median(times), "tokens": rows * sizes.train_seq,
            "loss": metrics[-1].loss, "spec": spec.layer_spec,
            "memory": gpu_memory_gib(mesh.device)}


def measure(sizes: Sizes, run, layer_spec: str, peak: tuple[float, str] | None,
            no_peak_reason: str) -> list[Row]:
    out = run(train_rank, sizes, layer_spec)
    if "skipped" in out:
        return [("", "", f"skipped: {out['skipped']}")]
    model = preset(sizes.train_preset)
    tokens_per_s = out["tokens"] / out["step_s"]
    per_token = train_flops_per_token(model, sizes.train_seq)
    achieved = per_token * tokens_per_s
    setting = (f"{sizes.train_preset} ({params_label(matmul_params(model))} matmul weights), "
               f"seq {sizes.train_seq}, {sizes.microbatches} x {sizes.micro_batch} seq/step, "
               f"{dtype_name(sizes.dtype)}, spec {out['spec']}")
    result = (f"{tokens_per_s:,.0f} tokens/s; {out['step_s']:.3f} s/step (median of "
              f"{sizes.steps}); {achieved / 1e12:.1f} model TFLOP/s; ")
    if peak is None:
        result += f"MFU not computed: {no_peak_reason}"
    else:
        result += (f"MFU {100 * mfu(per_token, tokens_per_s, peak[0]):.1f}% of "
                   f"{peak[0]:.0f} TFLOPs ({peak[1]})")
    result += f"; peak memory {out['memory']}; loss {out['loss']:.3f}"
    return [("", setting, result)]
