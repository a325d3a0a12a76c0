"""Qwen2.5-VL vision side (issue 66) against transformers' own implementation on a tiny random
model: the vision tower's merged features and the 3D M-RoPE position ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from megarlhf.models.vision.mrope import mrope_position_ids
from megarlhf.models.vision.qwen2_5_vl import (Qwen25VisionTower, VisionConfig,
                                               load_hf_state_dict, window_order)

IMAGE, VISION_START, VISION_END, PAD = 120, 121, 122, 0
MERGE = 2
# Window of 56 px = 2x2 merged tokens, so windows really split the images below; blocks 0 and 2
# attend in windows, 1 and 3 over the whole image.
VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
              temporal_patch_size=2, spatial_merge_size=MERGE, window_size=56,
              fullatt_block_indexes=[1, 3], out_hidden_size=24)
TEXT = dict(vocab_size=128, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 1e6})


@pytest.fixture(scope="module")
def hf_vl():
    config = transformers.Qwen2_5_VLConfig(
        vision_config=VISION, text_config=TEXT, image_token_id=IMAGE, video_token_id=123,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLModel(config).eval()
    # HF initialises norms to 1 and biases to 0; randomise everything so a weight loaded into the
    # wrong place, or a bias or norm left out, changes the output. Weights at 1/sqrt(fan-in) keep
    # activations of order 1 through the blocks, as in a trained model.
    with torch.no_grad():
        for name, p in model.visual.named_parameters():
            if p.dim() == 1:  # norm weights around 1, biases around 0
                is_norm = name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight"))
                p.copy_(float(is_norm) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    return model


def _pixels():
    """Two images through HF's processor: 8x12 patches (4x6 merged: 2x3 whole windows) and
    10x6 patches (5x3 merged: the last window row and column are cut short)."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (8 * 14, 12 * 14, 3), dtype=np.uint8),
              rng.integers(0, 256, (10 * 14, 6 * 14, 3), dtype=np.uint8)]
    processor = transformers.Qwen2VLImageProcessorPil(patch_size=14, merge_size=MERGE,
                                                      temporal_patch_size=2)
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def test_tower_matches_hf(hf_vl):
    pixel_values, grid_thw = _pixels()
    assert grid_thw.tolist() == [[1, 8, 12], [1, 10, 6]]
    # Guard the setup: 6 full windows of 4 tokens, then 6 windows of 4, 2, 4, 2, 2, 1 tokens.
    assert window_order(grid_thw, MERGE, 2)[1] == [4] * 6 + [4, 2, 4, 2, 2, 1]

    tower = Qwen25VisionTower(VisionConfig.from_hf(hf_vl.config.vision_config)).eval()
    load_hf_state_dict(tower, hf_vl.visual.state_dict())
    with torch.no_grad():
        want = hf_vl.visual(pixel_values, grid_thw=grid_thw).pooler_output
        got = tower(pixel_values, grid_thw)
    assert got.shape == (24 + 15, 24)
    # fp32 and the same operations, but the patch embedding is a Linear here and a Conv3d in HF
    # (another summation order over 1176 products), so rounding differs: measured 2.3e-6 at
    # most on outputs up to ~2. Dropping the window reordering, the per-window split or the
    # rotary each moves outputs by ~1.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _rows():
    """Three rows, 0, 1 and 2 images, padded on the left, right and not at all."""
    def text(n, seed):
        return torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def image(tokens):
        return [VISION_START] + [IMAGE] * tokens + [VISION_END]

    rows = [text(6, 0),
            text(3, 1) + image(24) + text(4, 2),
            text(2, 3) + image(15) + text(1, 4) + image(4) + text(9, 5)]
    seq = max(map(len, rows))
    ids = torch.full((3, seq), PAD)
    mask = torch.zeros(3, seq, dtype=torch.long)
    for b, (row, left) in enumerate(zip(rows, (True, False, True))):
        span = slice(seq - len(row), seq) if left else slice(0, len(row))
        ids[b, span], mask[b, span] = torch.tensor(row), 1
    assert mask.all(1).tolist() == [False, False, True]
    return ids, mask, torch.tensor([[1, 8, 12], [1, 10, 6], [1, 4, 4]])


def test_mrope_matches_hf(hf_vl):
    input_ids, mask, grid_thw = _rows()
    want_pos, want_delta = hf_vl.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=grid_thw,
        attention_mask=mask)
    got_pos, got_delta = mrope_position_ids(input_ids, grid_thw, image_token_id=IMAGE,
                                            spatial_merge_size=MERGE, attention_mask=mask)
    # The image rows compress positions, so the deltas are what decoding continues from.
    assert want_delta.flatten().tolist()[0] == 0 and (want_delta[1:] < 0).all()
    assert torch.equal(got_pos, want_pos)
    assert torch.equal(got_delta, want_delta)


def test_mrope_refuses_grid_placeholder_mismatch():
    input_ids, mask, grid_thw = _rows()
    with pytest.raises(ValueError, match="more image placeholder tokens"):
        mrope_position_ids(input_ids, grid_thw[:2], image_token_id=IMAGE,
                           spatial_merge_size=MERGE, attention_mask=mask)
    with pytest.raises(ValueError, match="needs 24 placeholder tokens, input_ids holds 15"):
        mrope_position_ids(input_ids, grid_thw[[0, 0, 2]], image_token_id=IMAGE,
                           spatial_merge_size=MERGE, attention_mask=mask)
