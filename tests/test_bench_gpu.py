"""bench/gpu: the dry run (CPU, tiny sizes) names every measurement and every skip reason and
writes nothing unless told; the MFU formula against a hand count; the plan's skip reasons for
GPU machines that lack a piece.

The dry run takes ~40 s on a 2-core machine (two GRPO runs, vLLM's start, imports): it runs
once per module, and its tests are marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.gpu import plan
from bench.gpu.mfu import matmul_params, mfu, peak_for, train_flops_per_token
from megarlhf.models.presets import preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(return code, stdout + stderr, files the run left in its working directory)."""
    cwd = tmp_path_factory.mktemp("dry_run")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, sorted(os.listdir(cwd))


@pytest.mark.slow
def test_dry_run_succeeds_and_writes_nothing(dry_run):
    code, output, files = dry_run
    assert code == 0, output
    assert "DRY RUN" in output
    assert files == []  # no BENCHMARKS.md (or anything else) without --append
    assert "Traceback" not in output and "FAILED" not in output, output


@pytest.mark.slow
def test_dry_run_names_every_measurement_and_skip_reason(dry_run):
    _, output, _ = dry_run
    for item in plan.ITEMS:
        assert item.title in output, item.title
    # This machine has no GPU in a dry run: the plan says a GPU run would skip everything.
    assert f"GPU run here: skip: {plan.NO_CUDA}" in output
    assert plan.TE_NEEDS_GPU in output
    if not plan.Machine.detect().te:
        assert plan.NO_TE in output
    assert "MFU not computed: dry run on CPU" in output
    assert "6*N + 12*L*(heads*head_dim)*S" in output  # the formula is stated
    vllm = plan.Machine.detect().vllm
    assert (plan.NO_VLLM in output) != vllm


@pytest.mark.slow
def test_dry_run_runs_each_measurement_at_tiny_size(dry_run):
    _, output, _ = dry_run
    table = output[output.index("DRY RUN - results"):]
    assert "tokens/s" in table.split("1a. training MFU, SDPA spec |")[1].splitlines()[0]
    for spec in ("local", "sdpa", "sdpa+lora"):
        row = table.split(f"2. CPU vs GPU parity, fp32: GPU spec {spec} |")[1].splitlines()[0]
        assert "PASS" in row, row
    assert "tokens/s" in table.split("3a. generation, Megatron engine |")[1].splitlines()[0]
    if plan.Machine.detect().vllm:
        assert "tokens/s" in table.split("3b. generation, vLLM engine |")[1].splitlines()[0]
    bridge = [line for line in table.splitlines() if line.startswith("| 4. weight bridge")]
    assert len(bridge) == 3 and all("GB/s" in line for line in bridge)
    assert "weights verified: True" in bridge[0]
    grpo = table.split("5. GRPO through the controller, one rank |")[1].splitlines()[0]
    gap, guard = re.search(r"logprob gap mean <= (\S+) \(guard (\S+)\)", grpo).groups()
    assert "s/step" in grpo and float(gap) < float(guard), grpo
    offload = table.split("6. offload round trip, pinned host memory |")[1].splitlines()[0]
    assert "GB/s" in offload and "bytes equal after the round trip: True" in offload, offload
    phase = table.split("7. RL training phase: the actor's old-logprob pass and update |")[1]
    assert phase.splitlines()[0].count("tokens/s") == 2, phase
    for part in ("rollout", "experience", "train", "sync"):
        row = table.split(f"8. profile: true on a GPU rank (GRPO, step 2 profiled): {part} |")
        assert "host operators" in row[1].splitlines()[0], part


def test_mfu_formula_by_hand():
    # llama-1b: h 2048, 32 heads x 64, 8 KV heads, ffn 8192, 16 layers, vocab 128256.
    # Per layer: Q and O 2 x 2048 x 2048 = 8,388,608; K and V 2 x 2048 x 512 = 2,097,152;
    # MLP 3 x 2048 x 8192 = 50,331,648; sum 60,817,408, x 16 = 973,078,528.
    # LM head 128256 x 2048 = 262,668,288. N = 1,235,746,816.
    model = preset("llama-1b")
    assert matmul_params(model) == 1_235_746_816
    # 6N = 7,414,480,896; attention 12 x 16 x 2048 x 4096 = 1,610,612,736.
    assert train_flops_per_token(model, 4096) == 9_025_093_632
    # 50,000 tokens/s -> 4.512546816e14 FLOP/s; on 989 TFLOPs: 0.456274...
    assert mfu(9_025_093_632, 50_000, 989.0) == pytest.approx(0.4562735, rel=1e-6)


def test_peak_by_gpu_name():
    assert peak_for("NVIDIA H100 80GB HBM3")[0] == 989.0  # SXM
    assert peak_for("NVIDIA H200")[0] == 989.0
    assert peak_for("NVIDIA H100 PCIe")[0] == 756.0
    assert peak_for("NVIDIA GeForce RTX 4090") is None
    assert peak_for(None) is None


def test_gpu_plan_skips_what_is_missing():
    bare = plan.Machine(cuda=True, gpu_name="NVIDIA H100 80GB HBM3", te=False, vllm=False)
    reasons = {item.key: plan.gpu_skip(item, bare) for item in plan.ITEMS}
    assert reasons == {"mfu-sdpa": None, "mfu-te": plan.NO_TE, "parity": None,
                       "gen-megatron": None, "gen-vllm": plan.NO_VLLM, "bridge": None,
                       "ppo": None, "offload": None, "rl-phase": None, "profile": None}
    full = plan.Machine(cuda=True, gpu_name="NVIDIA H200", te=True, vllm=True)
    assert all(plan.gpu_skip(item, full) is None for item in plan.ITEMS)
    cpu = plan.Machine(cuda=False, gpu_name=None, te=True, vllm=True)
    assert all(plan.gpu_skip(item, cpu) == plan.NO_CUDA for item in plan.ITEMS)
