"""LoRA adapters on megatron-core's parallel linear layers, one adapter per HF projection.

megatron-core has no LoRA. Each of the four linear layers of a transformer layer is replaced
by a subclass that adds `scale * B(A(x))` to its output:

- linear_qkv (column parallel, fused): q_proj, k_proj, v_proj;
- linear_fc1 (column parallel, fused [gate; up]): gate_proj, up_proj;
- linear_proj (row parallel): o_proj; linear_fc2 (row parallel): down_proj.

Adapters are per projection, as PEFT keeps them, so PEFT adapters map onto ours one to one:
each projection's output lands in its slice of the fused output (QKV is interleaved per KV
group: the group's query heads, its key head, its value head, the layout of
models/arch/llama_family's `_fuse_qkv`).

Tensor parallelism splits an adapter the way its base layer is split:

- column-parallel base: A replicated, B split by output rows. A(x) is computed on the
  replicated input (under sequence parallelism: on this rank's sequence shard, then gathered,
  which moves r channels instead of the hidden size) and enters the tensor-parallel region
  through megatron-core's copy (all-reduce in backward), so A's gradient is complete on every
  rank;
- row-parallel base: A split by input columns, B replicated. A's partial products are summed
  where the base layer sums (all-reduce, or reduce-scatter to sequence shards under sequence
  parallelism).

Under sequence parallelism a replicated factor that sees only this rank's sequence shard (A
of a column layer, B of a row layer) is marked `sequence_parallel`, so megatron-core
all-reduces its gradient over the tensor-parallel group as it does for layer norms.

The base weights are frozen (`freeze_base`): no gradient buffers, no optimizer state.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megarlhf.compat.megatron import first_pass_of_recomputed, recomputing
from megarlhf.models.peft_format import ATTENTION_TARGETS, MLP_TARGETS, TARGETS, adapter_settings

ALL_LINEAR = "all-linear"
INITS = ("kaiming", "gaussian")
_SEED_STRIDE = 1_000_003

LAYER_PROJECTIONS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Which HF projections each megatron-core linear layer holds, in fused order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the base model's linear layers (PEFT's LoRA); the base is frozen."""

    rank: int = 16
    """Rank r of each adapter (A is r x in, B is out x r)."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / r (alpha / sqrt(r) with
    use_rslora)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r), as PEFT's use_rslora."""
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    """HF projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj),
    or 'all-linear' for all seven."""
    init: str = "kaiming"
    """A's initialisation as PEFT does it: kaiming (kaiming-uniform, a = sqrt(5)) or gaussian
    (normal, std 1/r); B starts at zero either way, so step 0 is the base model."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training (PEFT's lora_dropout; a mask per
    projection), each element's from a hash of its global index and a seed of (step, layer,
    call, projection) (_LoraMixin._dropped): the same masks at any TP / SP layout, on a
    resume, and again when megatron-core recomputes. Not with context parallelism."""
    seed: int = 0
    """Seeds A, per layer and projection, so every parallel layout starts from the same
    adapters."""
    from_peft: str | None = None
    """Start from this HF PEFT LoRA adapter directory (SFT, RM, the PPO actor): rank, alpha,
    use_rslora, dropout and target_modules then come from its adapter_config.json and the
    projections its weights hold."""

    def __post_init__(self):
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.from_peft is not None:
            for name, value in adapter_settings(self.from_peft).items():
                object.__setattr__(self, name, value)
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha}")
        if self.init not in INITS:
            raise ValueError(f"lora.init {self.init!r} is not one of {INITS}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                raise ValueError(f"lora.target_modules {self.target_modules!r}: give a list of "
                                 f"{TARGETS} or {ALL_LINEAR!r}")
        else:
            unknown = sorted(set(self.target_modules) - set(TARGETS))
            if unknown or not self.target_modules:
                raise ValueError(f"lora.target_modules: {unknown or 'empty'} - the model's "
                                 f"linear projections are {TARGETS} (or {ALL_LINEAR!r})")

    @property
    def targets(self) -> tuple[str, ...]:
        """The targeted projections, in TARGETS order."""
        chosen = TARGETS if self.target_modules == ALL_LINEAR else self.target_modules
        return tuple(t for t in TARGETS if t in chosen)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def to_dict(self) -> dict:
        """What a checkpoint records: the adapters' settings (a from_peft source is read
        once, at the start; the checkpoint then holds the adapters)."""
        d = {**dataclasses.asdict(self), "target_modules": list(self.targets)}
        del d["from_peft"]
        return d


ROW_PARALLEL = ("o_proj", "down_proj")
"""Projections whose base layer is row parallel (A split by input); the rest are column
parallel (B split by output)."""


def projection_shapes(model) -> dict[str, tuple[int, int]]:
    """(in, out) features of each HF projection of a dense layer of `model` (a ModelConfig)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.kv_channels, model.kv_heads * model.kv_channels
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def layout_problem(lora: LoraConfig, parallel) -> str | None:
    """Why `lora` cannot run at `parallel` (a ParallelConfig), or None."""
    if lora.dropout and parallel.context_parallel > 1:
        return ("lora.dropout > 0 with context parallelism is not built (a rank's sequence "
                "chunks have no global positions in the linear layers); use dropout 0 there")
    return None


def check_model(lora: LoraConfig, *, is_moe: bool) -> None:
    """Refuse targets the model does not have as adapters (ValueError, one line)."""
    mlp = [t for t in lora.targets if t in MLP_TARGETS]
    if is_moe and mlp:
        raise ValueError(f"lora.target_modules {mlp}: adapters on a mixture-of-experts MLP are "
                         f"not supported; target the attention projections {ATTENTION_TARGETS}")


def _fused_out_sizes(layer: str, config, tp: int) -> dict[str, int]:
    """Each projection's output rows on one tensor-parallel rank."""
    if layer == "linear_qkv":
        d = config.kv_channels
        return {"q_proj": config.num_attention_heads * d // tp,
                "k_proj": config.num_query_groups * d // tp,
                "v_proj": config.num_query_groups * d // tp}
    return {"gate_proj": config.ffn_hidden_size // tp, "up_proj": config.ffn_hidden_size // tp}


def fuse_last_dim(layer: str, parts: dict[str, torch.Tensor], sizes: dict[str, int],
                  groups: int) -> torch.Tensor:
    """The fused layer's output (last dim) from each projection's output; a projection
    without an adapter contributes zeros. `groups`: the KV groups these rows hold (QKV)."""
    some = next(iter(parts.values()))
    lead = some.shape[:-1]
    full = [parts.get(name, some.new_zeros(*lead, sizes[name]))
            for name in LAYER_PROJECTIONS[layer]]
    if layer != "linear_qkv":
        return torch.cat(full, dim=-1)
    per_group = [t.reshape(*lead, groups, t.shape[-1] // groups) for t in full]
    return torch.cat(per_group, dim=-1).reshape(*lead, -1)


class _LoraMixin:
    """The adapter state and maths shared by the column and row layers."""

    lora: LoraConfig
    layer: str
    lora_enabled = True
    """False inside `adapters_off`: the layer is its base."""
    lora_layer_number = 0
    """The global (1-based) layer this linear belongs to (init_adapters sets it)."""
    lora_step_seed = lora_calls = 0
    """Dropout: the step's seed and this layer's forwards in it (start_dropout_step)."""

    def _init_adapters(self, config, in_size: int, out_sizes: dict[str, int], *,
                       a_split: bool) -> None:
        """Zero adapters of this rank's shapes; init_adapters gives A its values."""
        targets = [p for p in LAYER_PROJECTIONS[self.layer] if p in self.lora.targets]
        r, dtype = self.lora.rank, config.params_dtype
        self.lora_out_sizes = out_sizes
        self.lora_a_split = a_split
        self.lora_replays: collections.deque[int] = collections.deque()
        # Filled one by one: ParameterDict sorts the keys of a dict it is given, and the
        # projection order (q, k, v; gate, up) is the order masks are drawn in.
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for name in targets:
            self.lora_A[name] = torch.nn.Parameter(torch.zeros(r, in_size, dtype=dtype))
            self.lora_B[name] = torch.nn.Parameter(torch.zeros(out_sizes[name], r, dtype=dtype))
        # The split factor is tensor-parallel (megatron-core counts it on every rank in the
        # gradient norm; a replicated one only once).
        for split in (self.lora_A if a_split else self.lora_B).values():
            tensor_parallel.set_tensor_model_parallel_attributes(
                split, is_parallel=True, dim=1 if a_split else 0, stride=1)

    def _lora_sharded_axes(self) -> dict[str, int]:
        """The split factor's checkpoint axis (the other factor is replicated)."""
        if self.lora_a_split:  # row parallel: A by input columns
            return {f"lora_A.{name}": 1 for name in self.lora_A}
        return {f"lora_B.{name}": 0 for name in self.lora_B}  # column parallel: B by rows

    BASE_AXES: dict[str, int]
    """The checkpoint axes the base layer splits its own tensors along."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if not (self.lora_enabled and len(self.lora_A)):
            return output, bias
        delta = self._delta(self._to_b(self._a_out(input_)))
        return output + delta.to(output.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix,
            {**self.BASE_AXES, **self._lora_sharded_axes()}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def _a_out(self, x: torch.Tensor) -> torch.Tensor:
        """x through every adapter's A: [..., targets * r] (at once without dropout)."""
        if not (self.training and self.lora.dropout):
            return torch.matmul(x, torch.cat(list(self.lora_A.values()), dim=0).t())
        call, index = self._call_seed(), self._mask_index(x)
        return torch.cat([torch.matmul(
            self._dropped(x, index, call * len(TARGETS) + TARGETS.index(n)), a.t())
            for n, a in self.lora_A.items()], dim=-1)

    def start_dropout_step(self, seed: int) -> None:
        """A new optimizer step: dropout seeds restart from `seed` (TrainEngine.train_step)."""
        self.lora_step_seed, self.lora_calls = seed, 0
        self.lora_replays.clear()

    def _call_seed(self) -> int:
        """This forward's seed: from (step seed, layer, how many forwards this layer ran this
        step), so it depends neither on the layout nor on any generator (megatron-core runs
        sequence-parallel layers under a per-TP-rank generator). Full recomputation replays
        a layer's forwards in their order (1F1B and interleaved schedules run backwards
        first in, first out): a first pass queues its seed, the replay takes it."""
        if recomputing():
            return self.lora_replays.popleft()
        seed = ((self.lora_step_seed * _SEED_STRIDE + self.lora_layer_number) * _SEED_STRIDE
                + self.lora_calls) % (1 << 56)
        self.lora_calls += 1
        if first_pass_of_recomputed():
            self.lora_replays.append(seed)
        return seed

    def _mask_index(self, x: torch.Tensor) -> torch.Tensor:
        """Each element's global index in the layer's whole input [s, b, features]:
        (position x rows + row) x features + feature, from this rank's part of it
        (_input_offsets), so it does not depend on how TP / SP split the input or on
        padding the sequence."""
        s, b, f = x.shape
        row0, col0, width = self._input_offsets(s, f)
        rows = torch.arange(row0, row0 + s, device=x.device).view(s, 1, 1)
        cols = torch.arange(col0, col0 + f, device=x.device).view(1, 1, f)
        return (rows * b + torch.arange(b, device=x.device).view(1, b, 1)) * width + cols

    def _dropped(self, x: torch.Tensor, index: torch.Tensor, seed: int) -> torch.Tensor:
        """x with a dropout mask: each element's keep/drop is a hash of its global `index`
        and `seed`, so the TP ranks of a replicated input draw the same mask."""
        keep = _hash_uniform(index, seed) >= self.lora.dropout
        return x * keep.to(x.dtype) / (1 - self.lora.dropout)

    def _b_out(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        hs = h.split(self.lora.rank, dim=-1)
        return {name: torch.matmul(part, b.t()) * self.lora.scale
                for part, (name, b) in zip(hs, self.lora_B.items())}


_MULTIPLIERS = tuple(m - (1 << 64) for m in (
    0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
"""splitmix64's constants as signed 64-bit integers (torch has no unsigned int64)."""


def _hash_uniform(index: torch.Tensor, seed: int) -> torch.Tensor:
    """A uniform float in [0, 1) per int64 `index`, from splitmix64's finaliser over
    index x golden ratio + seed (products wrap, right shifts are made logical by masking)."""
    z = index * _MULTIPLIERS[0] + seed
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MULTIPLIERS[1]
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MULTIPLIERS[2]
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return (z & ((1 << 53) - 1)).double() / float(1 << 53)


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """A column-parallel layer (QKV or [gate; up]) with per-projection adapters."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        self._init_adapters(config, input_size,
                            _fused_out_sizes(self.layer, config, self.tp_size), a_split=False)
        if self.sequence_parallel:
            for a in self.lora_A.values():
                a.sequence_parallel = True
        self.lora_groups = config.num_query_groups // self.tp_size

    BASE_AXES = {"weight": 0, "bias": 0}

    def _input_offsets(self, s: int, f: int) -> tuple[int, int, int]:
        # The input is whole, or (sequence parallel) this rank's rows of the sequence.
        return (self.tp_rank * s if self.sequence_parallel else 0), 0, f

    def _to_b(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return tensor_parallel.gather_from_sequence_parallel_region(h, group=self.tp_group)
        return tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group)

    def _delta(self, h: torch.Tensor) -> torch.Tensor:
        return fuse_last_dim(self.layer, self._b_out(h), self.lora_out_sizes, self.lora_groups)


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """A row-parallel layer (o_proj or down_proj) with its adapter."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        (name,) = LAYER_PROJECTIONS[self.layer]
        self._init_adapters(config, input_size // self.tp_size, {name: output_size},
                            a_split=True)
        if self.sequence_parallel:
            for b in self.lora_B.values():
                b.sequence_parallel = True

    BASE_AXES = {"weight": 1}

    def _input_offsets(self, s: int, f: int) -> tuple[int, int, int]:
        # The input is this rank's columns (the base layer's input is parallel).
        return 0, self.tp_rank * f, f * self.tp_size

    def _to_b(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return tensor_parallel.reduce_scatter_to_sequence_parallel_region(
                h, group=self.tp_group)
        return tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)

    def _delta(self, h: torch.Tensor) -> torch.Tensor:
        (delta,) = self._b_out(h).values()
        return delta


def layer_classes(lora: LoraConfig) -> dict[str, type]:
    """The linear classes of a transformer layer's spec with `lora`, by spec field name
    (megatron-core calls linear_qkv's class directly, so each is a class, not a ModuleSpec)."""
    classes = {}
    for layer, projections in LAYER_PROJECTIONS.items():
        if not set(projections) & set(lora.targets):
            continue
        base = LoraRowParallelLinear if projections[0] in ROW_PARALLEL \
            else LoraColumnParallelLinear
        classes[layer] = type(f"Lora_{layer}", (base,), {"lora": lora, "layer": layer})
    return classes


def is_adapter_key(name: str) -> bool:
    """A parameter or checkpoint key of an adapter factor."""
    return ".lora_A." in name or ".lora_B." in name


def freeze_base(module: torch.nn.Module, *, trainable_head: bool) -> None:
    """Only the adapters train (and a value head, which a base LM does not have).

    The frozen embedding's output needs no gradient, so nothing before the first adapter
    would: megatron-core's full recomputation then returns outputs without a graph (its
    checkpoint function tracks gradients only for inputs that need them). The embedding's
    output is marked as needing one when gradients are on, as HF's
    enable_input_require_grads does."""
    for name, param in module.named_parameters():
        param.requires_grad = is_adapter_key(name) or (
            trainable_head and name.startswith("value_head."))
    embedding = getattr(module, "embedding", None)
    if embedding is not None:
        embedding.register_forward_hook(_output_requires_grad)


def _output_requires_grad(module, inputs, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_()


def start_dropout_step(chunks: list[torch.nn.Module], seed: int) -> None:
    """Restart every adapted layer's dropout seeds for an optimizer step."""
    for _, linear in lora_layers(chunks):
        linear.start_dropout_step(seed)


def lora_layers(chunks: list[torch.nn.Module]):
    """(global layer number, 1-based; adapted linear layer) of every adapted layer."""
    for chunk in chunks:
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                for linear in layer.modules():
                    if isinstance(linear, _LoraMixin):
                        yield layer.layer_number, linear


@torch.no_grad()
def init_adapters(module: torch.nn.Module) -> None:
    """Give every A its initial values (B stays zero): drawn over the full matrix from a
    generator seeded by (lora.seed, global layer number, projection), then sliced to this
    rank, so the adapters do not depend on the layout or on what else a rank built."""
    for layer_number, linear in lora_layers([module]):
        linear.lora_layer_number = layer_number
        for name, a in linear.lora_A.items():
            if a.is_meta:
                continue
            lora = linear.lora
            generator = torch.Generator().manual_seed(
                (lora.seed * _SEED_STRIDE + layer_number) * len(TARGETS) + TARGETS.index(name))
            width = a.shape[1] * (linear.tp_size if linear.lora_a_split else 1)
            full = torch.empty(a.shape[0], width)
            if lora.init == "kaiming":
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            else:
                torch.nn.init.normal_(full, std=1 / lora.rank, generator=generator)
            if linear.lora_a_split:
                full = full.chunk(linear.tp_size, dim=1)[linear.tp_rank]
            a.copy_(full)


@contextlib.contextmanager
def adapters_off(chunks: list[torch.nn.Module]):
    """Inside, the model is its frozen base (PPO's reference with LoRA)."""
    layers = [linear for _, linear in lora_layers(chunks)]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


def adapter_keys(mcore_key: str, hf_name: str, lora: LoraConfig) -> tuple[str, str] | None:
    """The checkpoint keys of (A, B) of the adapter on the HF projection `hf_name`, which the
    Megatron tensor `mcore_key` (a layer's linear weight) holds; None without one."""
    layer = mcore_key.removesuffix(".weight")
    projection = hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
    if (not mcore_key.endswith(".weight") or ".experts." in layer
            or layer.rsplit(".", 1)[-1] not in LAYER_PROJECTIONS
            or projection not in lora.targets):
        return None
    return f"{layer}.lora_A.{projection}", f"{layer}.lora_B.{projection}"


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: LoraConfig, *,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor W + scale * B @ A, computed in fp32 (one fp32 copy of W at a time) and
    returned in `dtype` (default W's); W is not touched."""
    out = weight.float()  # a copy when W is 16-bit; W itself when fp32, so clone then
    if out.data_ptr() == weight.data_ptr():
        out = out.clone()
    out.addmm_(b.float(), a.float(), alpha=lora.scale)
    return out.to(dtype or weight.dtype)
