"""Every parallel layout against TP1/PP1/DP1 on the same weights and data (gloo, CPU, fp32).

Tolerances: fp32 on CPU. TP splits matmuls and sums partial products in another order, so
results differ by rounding only: ~2e-7 measured on logits of magnitude ~1; we allow 1e-5
(50x headroom, still far below any real bug, which shows up at 1e-2 or more). Losses and grad
norms are compared relatively at 1e-5 for the same reason.
"""

from __future__ import annotations

import pytest
import torch

from megarlhf.data.embedded import byte_batches
from megarlhf.parallel import ParallelConfig as P
from megarlhf.parallel import launch_local
from tests import workers
from tests.grouping import grouped_launches, selected_ids

pytestmark = pytest.mark.slow
ATOL = 1e-5
LAYOUTS = {
    "tp2pp2": (P(tensor_parallel=2, pipeline_parallel=2), 4),
    "tp2pp1": (P(tensor_parallel=2), 2),
    "tp1pp2": (P(pipeline_parallel=2), 2),
    "tp2pp2dp2": (P(tensor_parallel=2, pipeline_parallel=2), 8),
    "tp2pp2vpp2": (P(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline_parallel=2), 4),
    "tp2sp": (P(tensor_parallel=2, sequence_parallel=True), 2),
    # Context parallelism: each rank runs 2 of 4 sequence chunks, attention gathers the keys.
    "cp2": (P(context_parallel=2), 2),
    "tp2cp2": (P(tensor_parallel=2, context_parallel=2), 4),
    "cp2pp2": (P(context_parallel=2, pipeline_parallel=2), 4),
}


@pytest.fixture(scope="module")
def batch(tiny):
    return workers.make_batch(tiny, batch=4, seq=16, seed=1)


def _grouped_outputs(cases: dict, batch: dict):
    """Forward outputs of named cases {name: (nprocs, ckpt, parallel, kwargs)}, each process
    count's cases in one launch (tests/grouping.py)."""
    return grouped_launches({name: (nprocs, workers.forward_outputs, (ckpt, parallel, batch),
                                    kwargs)
                             for name, (nprocs, ckpt, parallel, kwargs) in cases.items()})


@pytest.fixture(scope="module")
def lm_outputs(lm_ref, batch):
    cases = {"ref": (1, lm_ref, P(), {}),
             "sdpa": (2, lm_ref, P(tensor_parallel=2), {"layer_spec": "sdpa"})}
    for layout, (parallel, nprocs) in LAYOUTS.items():
        cases[layout] = (nprocs, lm_ref, parallel, {"microbatches": 2 if nprocs < 8 else 1})
    return _grouped_outputs(cases, batch)


@pytest.fixture(scope="module")
def ref_logits(lm_outputs):
    return lm_outputs("ref")[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_tp1pp1(layout, lm_outputs, tiny, ref_logits):
    outs = lm_outputs(layout)
    assert ref_logits.shape == (4, 16, tiny.vocab_size)
    assert ref_logits.std() > 0.1  # a real, non-degenerate output
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out, ref_logits, atol=ATOL, rtol=0, msg=f"rank {rank}")


def test_sdpa_spec_equals_local_spec(lm_outputs, ref_logits):
    outs = lm_outputs("sdpa")
    torch.testing.assert_close(outs[0], ref_logits, atol=ATOL, rtol=0)


TRAIN_LAYOUTS = {
    "tp2pp2dp2": (P(tensor_parallel=2, pipeline_parallel=2), 8),
    # Interleaved 1F1B: on gloo, batched p2p silently swaps micro-batches (measured; the
    # transformer config turns batching off on CPU, see models/transformer_config.py).
    "pp2vpp2dp2": (P(pipeline_parallel=2, virtual_pipeline_parallel=2), 4),
    "tp2sp_dp2": (P(tensor_parallel=2, sequence_parallel=True), 4),
    # Gradients summed over DP x CP, the token count once per sequence.
    "cp2dp2": (P(context_parallel=2), 4),
    "tp2sp_cp2": (P(tensor_parallel=2, sequence_parallel=True, context_parallel=2), 4),
}


@pytest.fixture(scope="module")
def train_batches():
    # Embedded text, so there is something to learn; part of one sequence masked so the DP
    # ranks hold different token counts (the gradient must be the global token mean).
    batches = byte_batches(seq=16, batch=4, steps=5)
    for b in batches:
        b["loss_mask"][0, :8] = 0
    return batches


@pytest.fixture(scope="module")
def ref_curve(lm_ref, tiny, train_batches):
    curve = launch_local(workers.train_curve, 2, lm_ref, tiny, P(), train_batches)[0]
    losses = [step[0] for step in curve]
    assert losses[-1] < losses[0] - 0.05, f"training did not reduce the loss: {losses}"
    return curve


@pytest.fixture(scope="module")
def train_curves(request, lm_ref, tiny, train_batches):
    """Each layout's curve; the selected layouts of one process count train in one launch."""
    return grouped_launches(
        {layout: (nprocs, workers.train_curve, (lm_ref, tiny, parallel, train_batches),
                  {"microbatches": 2})
         for layout, (parallel, nprocs) in TRAIN_LAYOUTS.items()},
        selected_ids(request, "test_train_curve_with_distopt_equals_tp1pp1dp2"))


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_train_curve_with_distopt_equals_tp1pp1dp2(layout, train_curves, ref_curve):
    workers.assert_same_curves(train_curves(layout), ref_curve)


@pytest.fixture(scope="module")
def value_outputs(value_refs, batch):
    cases = {}
    for tied, (_, path) in value_refs.items():
        cases[(tied, "ref")] = (1, path, P(), {})
        cases[(tied, "tp2pp2")] = (4, path, P(tensor_parallel=2, pipeline_parallel=2),
                                   {"microbatches": 2})
    return _grouped_outputs(cases, batch)


@pytest.mark.parametrize("tied", [False, True])
def test_value_head_pp2_equals_tp1pp1(tied, value_outputs):
    ref = value_outputs((tied, "ref"))[0]
    assert ref.shape == (4, 16) and ref.std() > 1e-3
    outs = value_outputs((tied, "tp2pp2"))
    for out in outs:
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_checkpoint_tp2pp2_resumes_at_tp1pp1(lm_ref, tiny, tmp_path, batch):
    """Train 4 steps at TP2xPP2 saving after 2; resume at TP1xPP1: steps 3-4 and logits equal."""
    batches = [workers.make_batch(tiny, batch=4, seq=16, seed=20 + i) for i in range(4)]
    ckpt = str(tmp_path / "step2")
    tp2pp2 = P(tensor_parallel=2, pipeline_parallel=2)
    # Training (saving after step 2), then the saved checkpoint's logits at TP2xPP2 on the
    # same 4 ranks, loaded by a fresh mesh and engine: one launch.
    straight, at_tp2pp2 = launch_local(workers.in_sequence, 4, [
        (workers.train_curve, (lm_ref, tiny, tp2pp2, batches),
         {"microbatches": 2, "save_to": ckpt, "save_after": 2}),
        (workers.forward_outputs, (ckpt, tp2pp2, batch), {})])[0]
    # Resumed training, then the saved checkpoint's logits at TP1xPP1: one rank, one launch.
    resumed, at_tp1 = launch_local(workers.in_sequence, 1, [
        (workers.train_curve, (lm_ref, tiny, P(), batches[2:]), {"resume_from": ckpt}),
        (workers.forward_outputs, (ckpt, P(), batch), {})])[0]
    for step, (a, b) in enumerate(zip(resumed, straight[2:]), start=3):
        assert a[0] == pytest.approx(b[0], rel=1e-5), f"step {step} loss"
        assert a[2] == pytest.approx(b[2], rel=1e-5), f"step {step} grad norm"
        assert a[3] == pytest.approx(b[3], rel=1e-12), f"step {step} lr"
    torch.testing.assert_close(at_tp1, at_tp2pp2, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def seed5_ckpt(tiny, tmp_path_factory):
    """Weights from another seed than the shared references, written once: each case only
    loads them (model-only) into a fresh engine of its own."""
    ckpt = str(tmp_path_factory.mktemp("seed5") / "seed5")
    launch_local(workers.write_reference, 1, ckpt, tiny, 5)
    return ckpt


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("distributed", [True, False], ids=["distopt", "no-distopt"])
def test_a_16_bit_engine_trains_from_the_weights_it_loaded(seed5_ckpt, dtype, distributed):
    # Found on a real model: bf16 GRPO from a converted checkpoint reached uniform outputs
    # (entropy = log(vocab)) after one step at lr 1e-5, because the fp32 master weights were
    # the pre-load random init. The shared reference weights (seed 0) ARE that init, which hid
    # it: these come from another seed. A step at lr 1e-9 moves weights by ~1e-9, which
    # changes a 16-bit weight only where its fp32 master (the checkpoint's fp32 value, with
    # the distributed optimizer) lies that close to a rounding midpoint: measured 3e-5 of
    # them in bf16. Stale master weights would change nearly all of them.
    changed = launch_local(workers.weight_change_of_a_16_bit_step, 1, seed5_ckpt, dtype,
                           distributed)[0]
    assert changed < 1e-3, changed


@pytest.mark.slow
def test_16_bit_masters_start_at_an_fp32_checkpoints_values_in_sft(seed5_ckpt):
    """Masters rounded to bf16 would sit on bf16's grid, where an update below half a bf16
    step never moves the model's weight (SmolLM2 at lr 1e-5: 3.8% of the weights moved after 5
    steps instead of 8.8%); SFT's initial load keeps the distributed optimizer's masters at
    the checkpoint's fp32 values. The PPO roles' load: test_real_model.py, on SmolLM2."""
    workers.check_fp32_masters(*launch_local(workers.sixteen_bit_masters, 1, seed5_ckpt,
                                             "bf16", "sft")[0], off_grid_share=0.9)
