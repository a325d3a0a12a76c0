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


# The language model of the conversion tests: 4 query heads over 2 KV heads (grouped, and
# splittable at TP2), 2 layers, and M-RoPE sections that differ, so a section given to the
# wrong axis moves the logits.
LM_TEXT = {**TEXT, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2,
           "rope_parameters": {"rope_type": "default", "mrope_section": [1, 2, 3],
                               "rope_theta": 1e6}}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A saved random Qwen2_5_VLForConditionalGeneration, every tensor randomised (biases and
    norms too, so one left out or misplaced shows)."""
    config = transformers.Qwen2_5_VLConfig(
        vision_config={**VISION, "out_hidden_size": 48}, text_config=LM_TEXT,
        image_token_id=IMAGE, video_token_id=123, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(float(name.endswith("norm.weight") or "norm" in name.split(".")[-2])
                        + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    path = tmp_path_factory.mktemp("vl") / "hf"
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def vl_ckpt(vl_dir, tmp_path_factory):
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from megarlhf.parallel.mesh import ParallelConfig

    out = str(tmp_path_factory.mktemp("vl") / "mc")
    hf_to_mcore(vl_dir, out, parallel=ParallelConfig())
    return out


def test_vl_export_is_bitwise(vl_dir, vl_ckpt, tmp_path):
    from megarlhf.convert.mcore_to_hf import mcore_to_hf
    from tests.test_convert import assert_same_tensors

    # Our checkpoint holds the patch embedding flattened, the export gives HF's Conv3d back.
    from megarlhf.convert.mcore_io import CheckpointReader
    assert CheckpointReader(vl_ckpt).shape("vision.patch_embed.proj.weight") == (32, 1176)
    out = mcore_to_hf(vl_ckpt, str(tmp_path / "hf"))
    assert_same_tensors(vl_dir, out)  # names (hub layout), dtypes and bits


def _vl_batch():
    """Row 0: two images of different grids (24 and 15 tokens) among text; row 1: text only,
    right-padded (so a causal mask alone keeps padding out of every real token's view)."""
    pixel_values, grid_thw = _pixels()
    g = torch.Generator().manual_seed(7)

    def text(n):
        return torch.randint(3, 100, (n,), generator=g).tolist()

    row0 = (text(3) + [VISION_START] + [IMAGE] * 24 + [VISION_END] + text(2) + [VISION_START]
            + [IMAGE] * 15 + [VISION_END] + text(5))
    row1 = text(20)
    ids = torch.full((2, len(row0)), PAD)
    ids[0], ids[1, :len(row1)] = torch.tensor(row0), torch.tensor(row1)
    mask = (torch.arange(len(row0)) < torch.tensor([[len(row0)], [len(row1)]])).long()
    return ids, mask, pixel_values, grid_thw


def _hf_vl_logits(vl_dir, input_ids, mask, pixel_values, grid_thw) -> torch.Tensor:
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir).eval()
    with torch.no_grad():
        # HF computes its own M-RoPE positions (get_rope_index) only when given the token
        # types its processor emits; without them it silently falls back to 1D positions.
        return hf(input_ids=input_ids, attention_mask=mask, pixel_values=pixel_values,
                  image_grid_thw=grid_thw, mm_token_type_ids=(input_ids == IMAGE).int()).logits


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_vl_logits_match_transformers(vl_dir, vl_ckpt, tp, pp):
    from megarlhf.convert.verify import ImageInputs, checkpoint_outputs
    from megarlhf.parallel import launch_local
    from megarlhf.parallel.mesh import ParallelConfig

    input_ids, mask, pixel_values, grid_thw = _vl_batch()
    positions, _ = mrope_position_ids(input_ids, grid_thw, image_token_id=IMAGE,
                                      spatial_merge_size=MERGE, attention_mask=mask)
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
    # verify's forward with images (every rank returns the logits).
    ours = launch_local(checkpoint_outputs, tp * pp, vl_ckpt, parallel, input_ids,
                        layer_spec="local",
                        images=ImageInputs(pixel_values, grid_thw, positions))[0]
    # In a fresh process as ours: once, after ~1200 tests in this process, HF's forward here
    # came out 1.3e-4 away (3e-6 alone, in a fresh pytest, and in the fast tier).
    want = launch_local(_hf_vl_logits, 1, vl_dir, input_ids, mask, pixel_values, grid_thw)[0]
    real = mask.bool()
    diff = (ours[real] - want[real]).abs().max().item()
    print(f"TP{tp}xPP{pp}: max |ours - HF| over real positions = {diff:.2e}")
    # Both fp32, differing only in summation order (fused QKV/MLP, Linear vs Conv3d patch
    # embedding, TP partial sums): measured 3.4e-6 (TP1), 2.2e-6 (TP2) on logits of order 1;
    # the issue asks 1e-4. 1D RoPE instead of M-RoPE moves them by 1.2, the images left out
    # by 5.2.
    assert diff <= 1e-4


def test_verify_checks_a_vl_checkpoint_on_images_at_tp2_pp2(vl_dir, vl_ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megarlhf.convert.verify import verify
    from megarlhf.parallel.mesh import ParallelConfig

    parallel = ParallelConfig(tensor_parallel=2, pipeline_parallel=2)
    report = verify(vl_dir, vl_ckpt, parallel)
    print(report)
    # verify's own rule, default tolerance 1e-4: both fp32 forwards are ~1e-6 from float64 on
    # these logits of order 1 (measured: ours 2.3e-6, HF fp32 3.8e-6).
    assert report.passed and report.top1_agreement == 1.0

    # The same checkpoint against an HF model whose first (windowed) vision block differs by a
    # 1% change of its attention weights: only the image tokens' features change, and verify
    # must see it, which it can only through the images.
    changed = tmp_path / "hf"
    shutil.copytree(vl_dir, changed)
    tensors = load_file(f"{vl_dir}/model.safetensors")
    tensors["visual.blocks.0.attn.qkv.weight"] *= 1.01
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    bad = verify(str(changed), vl_ckpt, parallel)
    print(bad)
    # Measured 2.3e-2 from float64, 230x the bound; HF's own fp32 error stays ~1e-6, so the
    # bound stays the 1e-4 tolerance and the failure is ours differing from HF.
    assert not bad.passed and bad.hf_fp32_diff < 1e-5

    # Refused before any rank starts: rows too short for the two images (2 x (6 placeholders
    # + start/end)) and 3 text tokens, and the interleaved schedule.
    with pytest.raises(ValueError, match="seq_len=18 is too short .* use --seq-len 19 or more"):
        verify(vl_dir, vl_ckpt, parallel, seq_len=18)
    with pytest.raises(ValueError, match="a vision-language model is verified on one micro-batch"):
        verify(vl_dir, vl_ckpt, ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=2))


def test_vl_model_config_round_trips_through_metadata_and_hf_config(vl_dir):
    import json

    from megarlhf.models.arch import architecture
    from megarlhf.models.config import ModelConfig

    arch = architecture("qwen2_5_vl")
    model = arch.model_config(transformers.AutoConfig.from_pretrained(vl_dir))
    assert model.mrope_section == (1, 2, 3) and model.image_token_id == IMAGE
    assert model.vision.fullatt_block_indexes == (1, 3)
    # As checkpoint metadata stores it (JSON). An export without the source's config.json
    # is refused: the vision token ids other than the image's are not in the model config.
    assert ModelConfig.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    with pytest.raises(ValueError, match="exports with the config.json of its hf/ sidecar"):
        arch.hf_config(model)
    assert arch.fits(model) and not architecture("qwen2").fits(model)
    # Hub config.json files spell the text fields at the top level, with
    # rope_scaling={"type": "mrope", ...}; transformers reads both spellings alike.
    hub = {k: v for k, v in LM_TEXT.items() if k != "rope_parameters"}
    hub_config = transformers.Qwen2_5_VLConfig(
        **hub, rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [1, 2, 3]},
        vision_config={**VISION, "out_hidden_size": 48}, image_token_id=IMAGE,
        tie_word_embeddings=False)
    assert arch.model_config(hub_config) == model


def test_vl_reads_transformers_module_names_and_refuses_value_roles(vl_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megarlhf.convert.hf_to_mcore import hf_to_mcore, inspect_hf
    from megarlhf.convert.mcore_to_hf import mcore_to_hf
    from megarlhf.parallel.mesh import ParallelConfig
    from tests.test_convert import assert_same_tensors

    # The names of transformers 5's module state_dict rather than of the hub files.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{vl_dir}/{f}", renamed / f)
    tensors = load_file(f"{vl_dir}/model.safetensors")
    save_file({("model." + n if n.startswith("visual.") else
                n.replace("model.", "model.language_model.", 1)
                if n.startswith("model.") else n): t for n, t in tensors.items()},
              renamed / "model.safetensors", metadata={"format": "pt"})
    hf_to_mcore(str(renamed), str(tmp_path / "mc"), parallel=ParallelConfig())
    assert_same_tensors(vl_dir, mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf")))

    with pytest.raises(ValueError, match="no value-model form here; convert it as actor or ref"):
        inspect_hf(vl_dir, role="critic", init_value_head=True)


def test_training_stages_refuse_a_vision_language_model_before_launch(vl_dir, vl_ckpt):
    # It converts and verifies, but no stage feeds images yet: a PPO role read from the
    # checkpoint or the HF directory, and an SFT/DPO model, are refused in one line.
    from megarlhf.ppo.sources import resolve
    from megarlhf.sft.config import ModelSource
    from megarlhf.sft.model import model_config

    for path in (vl_ckpt, vl_dir):
        with pytest.raises(ValueError, match=f"actor {path} is a vision-language model"):
            resolve(path, field="actor", value_head=False)
    with pytest.raises(ValueError, match="is a vision-language model .* not supported yet"):
        model_config(ModelSource(checkpoint=vl_ckpt), value_head=False)
    # A judge or an HF-directory teacher (judge_model), and a preset made multimodal through
    # its overrides (M-RoPE without a tower crashes on text positions just the same).
    from megarlhf.ppo.judge import judge_model

    for path in (vl_ckpt, vl_dir):
        with pytest.raises(ValueError, match=f"reward_judge.model {path} is a vision-language"):
            judge_model(path)
    with pytest.raises(ValueError, match="model.preset tiny with its overrides is a vision"):
        model_config(ModelSource(preset="tiny", overrides={"mrope_section": [2, 3, 3]}),
                     value_head=False)


def test_a_vision_language_model_refuses_sequence_and_context_parallel(vl_ckpt):
    from megarlhf.engine.checkpoint import read_meta
    from megarlhf.models.config import ModelConfig
    from megarlhf.models.gpt import model_spec
    from megarlhf.parallel.mesh import ParallelConfig

    model = ModelConfig.from_dict(read_meta(vl_ckpt)["model"])
    for parallel in (ParallelConfig(tensor_parallel=2, sequence_parallel=True),
                     ParallelConfig(context_parallel=2)):
        with pytest.raises(ValueError, match="runs without sequence_parallel and with "
                                             "context_parallel=1"):
            model_spec(model, parallel, on_gpu=False)
