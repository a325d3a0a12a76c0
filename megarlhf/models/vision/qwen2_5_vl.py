"""The Qwen2.5-VL vision tower (ViT with 2D rotary, window attention and a 2x2 patch merger).

Input is what the HF image processor emits: `pixel_values` (num_patches, C*T*P*P), each row one
already-flattened patch, patches of an image in merge-block order (the m*m patches that merge
into one token are consecutive), and `grid_thw` (num_images, 3) in patches. Output is one row
of `out_hidden_size` per merged token, images concatenated in input order, tokens of an image
in the order its placeholder tokens take in the prompt.

Most blocks attend only within windows of `window_size` pixels (window_size // patch_size //
spatial_merge_size merged tokens a side); the blocks in `fullatt_block_indexes` attend over a
whole frame. Patches are reordered once so that every window is contiguous, run through all
blocks in that order, and put back after the merger.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf(cls, hf) -> VisionConfig:
        """From a transformers `Qwen2_5_VLVisionConfig` (`AutoConfig...vision_config`), not from
        the raw config.json dict: hub files omit fields (rope_theta) or spell them differently
        (`in_chans`), and only the config class fills in the values HF actually runs with."""
        if hf.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act={hf.hidden_act!r}: the Qwen2.5-VL tower "
                             "here implements only 'silu' (what every released checkpoint uses)")
        rope = hf.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: "
                             "only the axial 2D rope of Qwen2.5-VL is implemented")
        return cls(depth=hf.depth, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size, num_heads=hf.num_heads,
                   out_hidden_size=hf.out_hidden_size, patch_size=hf.patch_size,
                   temporal_patch_size=hf.temporal_patch_size, in_channels=hf.in_channels,
                   spatial_merge_size=hf.spatial_merge_size, window_size=hf.window_size,
                   fullatt_block_indexes=tuple(hf.fullatt_block_indexes),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        """From `dataclasses.asdict` after a JSON round trip (lists back to tuples)."""
        return cls(**{**d, "fullatt_block_indexes": tuple(d["fullatt_block_indexes"])})


class RMSNorm(nn.Module):
    """Normalises in fp32 and casts back before the weight, as HF does (eps fixed at 1e-6 in HF's
    vision tower, not read from the config). Not `megarlhf.models.layers.RMSNorm`: that one
    needs a megatron TransformerConfig and carries sequence-parallel flags this tower has no
    use for."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class PatchEmbed(nn.Module):
    """HF's Conv3d has kernel = stride = the whole flattened patch, so it is a bias-free Linear
    over the row; `load_hf_state_dict` flattens the conv weight (C, T, P, P) in the same order
    the processor flattened the pixels."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.proj = nn.Linear(patch_dim, cfg.hidden_size, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # The processor hands out fp32 pixels; the tower may run in bf16.
        return self.proj(pixel_values.to(self.proj.weight.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the whole head dim, half-split convention, in fp32 like HF."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x, cos, sin, segment_lens: list[int]) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each (n, heads, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (heads, n, hd)
        # One SDPA call per segment (frame or window) rather than one call under a dense
        # block-diagonal mask: same result, but memory grows with the largest segment instead of
        # the square of all patches of the batch (thousands per real image). On GPU this is
        # where a varlen flash kernel over cumulative segment lengths would go.
        out = torch.cat([F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in
                         zip(q.split(segment_lens, 1), k.split(segment_lens, 1),
                             v.split(segment_lens, 1))], dim=1)
        return self.proj(out.transpose(0, 1).reshape(n, dim))


class MLP(nn.Module):
    """SwiGLU with biases."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, segment_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segment_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates the m*m consecutive patches of each merge block into one token. `mlp` is a
    Sequential so its parameters are named `mlp.0.*` / `mlp.2.*` like HF's."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        merged_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(merged_dim, merged_dim), nn.GELU(),
                                 nn.Linear(merged_dim, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x)
        return self.mlp(x.reshape(-1, self.mlp[0].in_features))


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(num_patches, 2) row and column of every patch in the processor's order: per frame, merge
    blocks in raster order, and the m*m patches of a block in raster order inside it."""
    coords = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        # (h, w) -> (block row, row in block, block col, col in block) -> blocks outermost.
        rc = torch.stack((rows, cols), -1).view(h // merge, merge, w // merge, merge, 2)
        coords.append(rc.permute(0, 2, 1, 3, 4).reshape(-1, 2).repeat(t, 1))
    return torch.cat(coords)


def window_order(grid_thw: torch.Tensor, merge: int,
                 window: int) -> tuple[torch.Tensor, list[int]]:
    """Order of the merged tokens that makes every attention window contiguous, and the window
    lengths in that order (in merged tokens).

    A window is `window` x `window` merged tokens of one frame; windows at the right and bottom
    edges are cut short when the grid is not a multiple of `window`. Windows follow each other
    in raster order, tokens inside a window too. Sorting the tokens (raster order) by their
    window number with a stable sort gives exactly that order.
    """
    order, lens, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        rows, cols = h // merge, w // merge
        win_rows, win_cols = -(-rows // window), -(-cols // window)
        frame = torch.arange(t).view(t, 1, 1)
        row = torch.arange(rows).view(1, rows, 1) // window
        col = torch.arange(cols).view(1, 1, cols) // window
        window_id = ((frame * win_rows + row) * win_cols + col).flatten()
        order.append(torch.argsort(window_id, stable=True) + offset)
        lens += torch.bincount(window_id).tolist()  # every window holds at least one token
        offset += t * rows * cols
    return torch.cat(order), lens


class Qwen25VisionTower(nn.Module):
    """pixel_values (num_patches, C*T*P*P), grid_thw (num_images, 3) -> (num_merged_tokens,
    out_hidden_size); see the module docstring for the orders."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def rotary(self, grid_thw: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (num_patches, 1, head_dim), fp32, in the processor's patch order.
        Computed per call rather than kept as a buffer, which `module.to(bfloat16)` would round."""
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        # Half of the rotary pairs turn with the row, half with the column.
        inv_freq = 1.0 / self.cfg.rope_theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float, device=device) / (head_dim // 2))
        coords = patch_coordinates(grid_thw, self.cfg.spatial_merge_size).to(device)
        angles = (coords[..., None].float() * inv_freq).flatten(1)  # [rows | cols]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        unit = cfg.spatial_merge_size ** 2  # patches per merged token
        window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        token_order, window_lens = window_order(grid_thw, cfg.spatial_merge_size, window)
        token_order = token_order.to(pixel_values.device)
        # Move whole merge blocks so the m*m patches of a token stay together for the merger.
        within = torch.arange(unit, device=token_order.device)
        patch_order = (token_order[:, None] * unit + within).flatten()
        window_lens = [n * unit for n in window_lens]
        frame_lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]

        x = self.patch_embed(pixel_values)[patch_order]
        cos, sin = (r[patch_order] for r in self.rotary(grid_thw, pixel_values.device))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lens if i in cfg.fullatt_block_indexes else window_lens)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[token_order] = merged  # back to the processor's (placeholder) order
        return out


def load_hf_state_dict(tower: Qwen25VisionTower, hf_visual: dict[str, torch.Tensor]) -> None:
    """Load HF's vision weights, keys relative to the tower: strip `visual.` from hub
    safetensors keys, or `model.visual.` from a transformers 5 module's state_dict. Every name
    is HF's; only the patch conv weight (D, C, T, P, P) is flattened to the Linear's (D, C*T*P*P).
    Strict: a missing or unexpected key raises."""
    state = dict(hf_visual)
    conv = state["patch_embed.proj.weight"]
    state["patch_embed.proj.weight"] = conv.reshape(conv.shape[0], -1)
    tower.load_state_dict(state, strict=True)
