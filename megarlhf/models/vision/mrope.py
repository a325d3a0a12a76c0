"""Qwen2.5-VL's 3D M-RoPE position ids for prompts with images.

Every token gets three positions (temporal, height, width). A text token has the same value on
all three, one more than the token before. The tokens of an image (one per merged patch, in
raster order over the merged grid) all start from the position p the next text token would have
had: temporal p (images have one frame), height p + row, width p + column. Text after the image
continues at p + max(merged rows, merged columns), so positions grow more slowly than token
indices and each row ends with a "delta" = last position + 1 - number of tokens. While decoding,
a new token at index i of its row (padding not counted) gets position i + delta on all three axes.

Images only: video frames would space the temporal axis by `tokens_per_second` and are out of
scope, so no timing argument is taken.
"""

from __future__ import annotations

import itertools

import torch


def _image_positions(start: int, t: int, rows: int, cols: int) -> torch.Tensor:
    """(3, t*rows*cols) positions of one image's tokens starting at `start`."""
    grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols),
                                      indexing="ij"))
    return grid.reshape(3, -1) + start


def _row_positions(row: torch.Tensor, grids, image_token_id: int, merge: int) -> torch.Tensor:
    """(3, len(row)) positions of one unpadded row, taking its images' grids from `grids`."""
    chunks, next_pos = [], 0
    for is_image, run in itertools.groupby((row == image_token_id).tolist()):
        n = len(list(run))
        if not is_image:
            chunks.append(torch.arange(next_pos, next_pos + n).expand(3, n))
            next_pos += n
            continue
        # A run of placeholders may hold several images if nothing separates them.
        while n > 0:
            t, h, w = next(grids, (None, None, None))
            if t is None:
                raise ValueError("more image placeholder tokens in input_ids than images in "
                                 "image_grid_thw")
            rows, cols = h // merge, w // merge
            if t * rows * cols > n:
                raise ValueError(f"an image with grid (t, h, w)=({t}, {h}, {w}) needs "
                                 f"{t * rows * cols} placeholder tokens, input_ids holds {n}")
            chunks.append(_image_positions(next_pos, t, rows, cols))
            next_pos += max(rows, cols)
            n -= t * rows * cols
    return torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *,
                       image_token_id: int, spatial_merge_size: int,
                       attention_mask: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (3, batch, seq) and rope deltas (batch, 1) for a batch of token rows.

    `image_grid_thw` (num_images, 3) lists the images of all rows in the order their
    placeholders appear, row by row, as the HF processor returns them. Padding (attention_mask
    0, on either side) is skipped when counting positions and gets position 0. Images are found
    as runs of `image_token_id`; the vision start/end tokens around them are ordinary text
    tokens here, as in HF.
    """
    batch, seq = input_ids.shape
    keep = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.bool())
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    position_ids = torch.zeros(3, batch, seq, dtype=torch.long, device=input_ids.device)
    deltas = torch.zeros(batch, 1, dtype=torch.long, device=input_ids.device)
    for b in range(batch):
        row = input_ids[b][keep[b]].cpu()
        positions = _row_positions(row, grids, image_token_id, spatial_merge_size)
        position_ids[:, b, keep[b]] = positions.to(input_ids.device)
        if len(row):
            deltas[b] = positions.max() + 1 - len(row)
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw lists more images than input_ids has placeholders for")
    return position_ids, deltas
