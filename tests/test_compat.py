"""megarlhf.compat: each shim still needed by the library versions installed, each version
gate clear. A test here fails when the upstream behaviour a shim works around changes, so an
upgrade shows which shim to revisit (or delete)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import types

import pytest
import torch

from megarlhf import compat
from megarlhf.compat import megatron as mcore_shims
from megarlhf.parallel import launch_local
from megarlhf.models.presets import preset
from tests import workers

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins are for CPU")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")


def test_a_version_outside_the_range_is_refused_in_one_line():
    with pytest.raises(compat.UnsupportedVersion) as refused:
        compat.require("megatron-core", "0.15.0", mcore_shims.SUPPORTED, install="pip install x")
    assert str(refused.value) == ("megatron-core 0.15.0 is installed; megarlhf supports "
                                  "megatron-core>=0.16.1,<0.20: pip install x")
    assert compat.require("megatron-core", "0.19.2", mcore_shims.SUPPORTED, install="")
    with pytest.raises(compat.UnsupportedVersion):
        compat.require("megatron-core", "0.20.0rc1", mcore_shims.SUPPORTED, install="")


def test_a_command_reports_an_unsupported_version_in_one_line(capsys):
    from megarlhf.errors import run_command

    def command():
        compat.require("megatron-core", "0.15.0", mcore_shims.SUPPORTED,
                       install='pip install "megatron-core>=0.16.1,<0.20"')

    assert run_command(command) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        'error: megatron-core 0.15.0 is installed; megarlhf supports megatron-core>=0.16.1,'
        '<0.20: pip install "megatron-core>=0.16.1,<0.20"']


def test_the_megatron_core_under_test_is_the_one_expected():
    """`make test-mcore-newest` runs the suite against a second megatron-core put first on
    PYTHONPATH; this fails if the path did not take and the suite silently re-tested the
    venv's."""
    import os

    from packaging.version import Version

    expected = os.environ.get("MEGARLHF_EXPECT_MCORE")
    # megatron-core appends a local "+<git hash>" when it sits inside a git checkout (the
    # second install lives in the repo's .venv): compare the release itself.
    assert Version(mcore_shims.VERSION.public) == Version(expected or mcore_shims.VERSION.public)
    assert mcore_shims.VERSION >= Version("0.16.1")


@cpu_only
def test_rewrites_are_confined_to_megatron_callers():
    assert mcore_shims.apply_cpu_compat() is True
    # Our own code asking for CUDA on a CPU machine still fails loudly...
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    assert torch.ones(2).type() == "torch.FloatTensor"
    # ...while megatron-core's factory calls and type checks are redirected.
    from megatron.core.tensor_parallel import utils as mutils  # any megatron module namespace

    code = compile("torch.zeros(1, device='cuda').type()", mutils.__file__, "eval")
    assert eval(code, {"__name__": mutils.__name__, "torch": torch}) == "torch.cuda.FloatTensor"


@cpu_only
def test_trace_lists_every_redirected_megatron_site():
    sites = launch_local(workers.traced_sites_of_a_step, 1, preset("tiny"))[0]
    assert sites, "a CPU train step must go through redirected sites"
    assert all(s.startswith("megatron/core/") for s in sites), sites
    kinds = {s.split(" ", 1)[1] for s in sites}
    # The CUDA assumptions megatron-core makes on the training path (the stand-ins' reason).
    assert "torch.cuda.current_device()" in kinds
    assert "Tensor.type()" in kinds  # grad clipping / distributed optimizer type checks
    assert any("schedules.py" in s for s in sites)


@cpu_only
def test_device_context_still_works_after_compat():
    # The compat layer wraps torch factories; `with torch.device("meta")` must keep creating
    # meta tensors (meta-model building and transformers' from_pretrained rely on it). A fresh
    # interpreter, so no earlier use of device contexts can mask the fault.
    code = (
        "import torch\n"
        "from megarlhf.compat.megatron import apply_cpu_compat\n"
        "apply_cpu_compat()\n"
        "with torch.device('meta'):\n"
        "    made = [torch.arange(3), torch.empty(2), torch.zeros(2), torch.ones(2),\n"
        "            torch.full((2,), 1.0), torch.randn(2), torch.tensor([1.0])]\n"
        "print(sorted({t.device.type for t in made}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['meta']"


def test_the_distributed_optimizer_still_fails_to_load_torch_adam_state_unaided():
    """megatron-core's `_set_main_param_and_optimizer_states` copies every key of the live
    Adam state from the loaded one, which keeps torch Adam's 'step' elsewhere: KeyError, which
    `torch_adam_load_fixes` prevents. Driven on a stand-in optimizer with one parameter."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    main = torch.zeros(3)
    adam = torch.optim.Adam([main])
    adam.state[main] = {"step": torch.tensor(4.0), "exp_avg": torch.zeros(3),
                        "exp_avg_sq": torch.zeros(3)}
    model_param = torch.zeros(3)
    stand_in = types.SimpleNamespace(
        optimizer=adam, model_param_group_index_map={model_param: (0, 0)},
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    loaded = {"param": torch.ones(3), "exp_avg": torch.full((3,), 2.0),
              "exp_avg_sq": torch.full((3,), 3.0)}
    upstream = DistributedOptimizer._set_main_param_and_optimizer_states
    with pytest.raises(KeyError, match="step"):
        upstream(stand_in, model_param, loaded)
    stand_in._set_main_param_and_optimizer_states = types.MethodType(upstream, stand_in)
    with mcore_shims.torch_adam_load_fixes(stand_in):
        stand_in._set_main_param_and_optimizer_states(model_param, loaded)
    assert torch.equal(main, torch.ones(3))
    assert torch.equal(adam.state[main]["exp_avg_sq"], torch.full((3,), 3.0))
    assert adam.state[main]["step"].item() == 4.0


def test_gpt_forward_still_ends_in_the_private_postprocess_hook():
    """`PostprocessHook` (the value head) relies on GPTModel.forward handing the decoder's
    output to `self._postprocess(hidden_states=...)`."""
    from megatron.core.models.gpt import GPTModel

    forward = inspect.getsource(GPTModel.forward)
    assert "self._postprocess(" in forward and "hidden_states=hidden_states" in forward
    assert "hidden_states" in inspect.signature(GPTModel._postprocess).parameters


def test_moe_router_gating_still_reads_te_general_gemm():
    """`bind_missing_te_names`: the router's gating picks its matmul by whether
    `te_general_gemm` is None; 0.16.1 binds that name only when Transformer Engine imports."""
    from megatron.core.transformer.moe import moe_utils

    mcore_shims.bind_missing_te_names()
    assert "te_general_gemm is not None" in inspect.getsource(
        moe_utils.RouterGatingLinearFunction.forward)
    assert moe_utils.te_general_gemm is None or moe_utils.HAVE_TE


# Read from each release's router: 0.19.0 is the first to multiply the load-balancing loss
# by the TP x CP group's size itself.
_SCALES_BY_SPLIT_GROUP_FROM = "0.19.0"


def _split_factor_expected(version: str) -> int:
    from packaging.version import Version

    return 1 if Version(version) >= Version(_SCALES_BY_SPLIT_GROUP_FROM) else 4


def test_moe_aux_loss_split_factor_of_the_loaded_release():
    """`aux_loss_split_factor` finds by a probe what the release's router does with the
    loss of a split sequence (tests/test_moe.py's TP2+SP and CP2 curves check the effect)."""
    assert mcore_shims.aux_loss_split_factor(4) == _split_factor_expected(
        mcore_shims.VERSION.public)
    assert mcore_shims.aux_loss_split_factor(1) == 1


_PROBED = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".venv")


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.17.0", "0.18.0"])
def test_moe_aux_loss_split_factor_of_the_releases_between(version):
    """The same probe on the releases between the venv's and the newest (installed beside the
    venv by `make test`, MCORE_PROBED), each in a process of its own."""
    target = os.path.join(_PROBED, f"megatron-core-{version}")
    assert os.path.isdir(target), f"{target} missing: `make test` installs it"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c",
         "from megarlhf.compat import megatron as m; "
         "print(m.VERSION.public, m.aux_loss_split_factor(4))"],
        env={**os.environ, "PYTHONPATH": target}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [version, str(_split_factor_expected(version))]


def _replay_canary() -> dict:
    """One rank: the tiny preset with 4 experts per layer routes a batch freely, then replays a routing that sends
    every token to experts (3, 0); what the routers returned each time."""
    import dataclasses

    from megarlhf.models.gpt import build_model, model_spec
    from megarlhf.models.routing_replay import RoutingReplay, local_order
    from megarlhf.parallel.mesh import ParallelConfig, init_mesh

    moe = dataclasses.replace(preset("tiny"), num_experts=4, moe_ffn_hidden_size=32,
                              moe_router_topk=2)
    mesh = init_mesh(ParallelConfig(), seed=0)
    (chunk,) = build_model(model_spec(moe, ParallelConfig(), on_gpu=False), mesh)
    maps = []
    for _, router in mcore_shims.moe_routers(chunk):
        router.register_forward_hook(lambda m, i, out: maps.append(out[1].detach().clone()))
    replay = RoutingReplay([chunk])
    tokens = torch.randint(0, moe.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad(), replay.record():
        chunk(tokens, positions, None)
    free = [m.nonzero()[:, 1].view(-1, 2).sort(1).values for m in maps]
    recorded = [r.long().sort(-1).values for r in replay.take_recorded()[0].unbind(1)]
    given = torch.tensor([3, 0]).expand(2, 8, moe.num_layers, 2)
    maps.clear()
    with torch.no_grad(), replay.replay():
        replay.feed(chunk, local_order(given, mesh, sequence_parallel=False))
        chunk(tokens, positions, None)
    replayed = [m.nonzero()[:, 1].view(-1, 2).sort(1).values for m in maps]
    return {"free_equals_record": all(torch.equal(f, r) for f, r in zip(free, recorded)),
            "free_differs": any(not bool((f == torch.tensor([0, 3])).all()) for f in free),
            "replayed": [bool((r == torch.tensor([0, 3])).all()) for r in replayed],
            "layers": moe.num_layers, "moved": replay.moved_fraction(torch.device("cpu"))}


def test_moe_routers_still_take_their_top_k_from_the_replay_slot():
    """`attach_replay_slot`: every routing asks the router's replay slot for its top-k, whose
    answer the router then uses. Recording sees the router's own choice; replaying a given
    routing sends every token of every layer to the given experts."""
    out = launch_local(_replay_canary, 1)[0]
    assert out["free_equals_record"] and out["free_differs"], out
    assert out["replayed"] == [True] * out["layers"], out
    assert 0 < out["moved"] <= 1, out


def _dcp_load_calls(source: str) -> dict[str, list[tuple[int, list[str]]]]:
    """The calls `checkpoint.<name>(...)` in `source`: name -> [(positional arguments,
    keywords)]."""
    import ast
    import textwrap

    calls: dict[str, list[tuple[int, list[str]]]] = {}
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "checkpoint":
            calls.setdefault(node.func.attr, []).append(
                (len(node.args), [k.arg for k in node.keywords]))
    return calls


def test_megatron_core_before_0_18_still_loads_through_the_deprecated_dcp_call():
    """`load_dist_checkpoint`: torch still deprecates `dcp.load_state_dict`; 0.16 and 0.17
    load torch_dist files with it, called with the arguments the stand-in takes through
    their module's `checkpoint`, and later versions call `dcp.load` themselves."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from packaging.version import Version

    assert "deprecated" in getattr(dcp.load_state_dict, "__deprecated__", "")
    assert torch_strategy.checkpoint is dcp
    calls = _dcp_load_calls(inspect.getsource(torch_strategy.TorchDistLoadShardedStrategy.load))
    if mcore_shims.VERSION < Version("0.18"):
        assert calls == {"load_state_dict": [(2, ["planner"])]}
    else:
        assert "load_state_dict" not in calls and len(calls["load"]) == 1


def test_a_checkpoint_saves_in_this_process_and_loads_without_a_deprecated_call(tmp_path):
    """A model saved and loaded back in one process: equal weights, no warning a plain run
    would print (the filters of compat/warnings.py applied, none of pytest's), and no process
    left by the save (`save_dist_checkpoint`: megatron-core's results queue in this process,
    not in a spawned manager that outlives the save)."""
    import warnings

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megarlhf.compat.warnings import quiet_known_warnings
    from megarlhf.convert.mcore_io import single_rank_mesh
    from megarlhf.engine.checkpoint import load_checkpoint, save_checkpoint
    from megarlhf.engine.train import TrainEngine
    from megarlhf.parallel.mesh import ParallelConfig

    path = str(tmp_path / "ckpt")
    with single_rank_mesh() as mesh:
        spec = workers.make_spec(preset("tiny"), ParallelConfig())
        saved = TrainEngine(spec, mesh)
        assert hasattr(filesystem_async, "_results_queue")  # what the shim fills
        children = {p.pid for p in psutil.Process().children()}
        save_checkpoint(path, saved, mesh, with_optimizer=False)
        assert {p.pid for p in psutil.Process().children()} <= children
        loaded = TrainEngine(spec, mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            quiet_known_warnings()
            load_checkpoint(path, loaded, with_optimizer=False)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    before, after = saved.chunks[0].state_dict(), loaded.chunks[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before
               if isinstance(before[k], torch.Tensor))


@needs_vllm
def test_vllm_weight_updates_still_skip_the_cpu_expert_prepack():
    """`prepack_reloaded_experts`: on a weight update vLLM's unquantized MoE method copies the
    new weights in but runs the experts' own post-load step (CPU: pad and prepack) only on
    the first load."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method

    source = inspect.getsource(method.UnquantizedFusedMoEMethod._setup_kernel)
    first_load_only = source[source.index("if not is_weight_update:"):]
    assert "fused_experts.process_weights_after_loading(layer)" in first_load_only


@needs_vllm
def test_vllm_teardown_still_destroys_the_default_process_group():
    """`keep_trainer_process_group` replaces `destroy_distributed_environment` with its body
    minus the destruction of the default group; it must still be that body."""
    from vllm.distributed import parallel_state

    source = inspect.getsource(parallel_state)
    body = source[source.index("def destroy_distributed_environment"):]
    body = body[:body.index("\ndef ")]
    for statement in ("_WORLD.destroy()", "_WORLD = None", "_NODE_COUNT = None",
                      "torch.distributed.destroy_process_group()"):
        assert statement in body, body
    assert body.count("\n    ") <= 8, body  # nothing else added that the shim would drop


@needs_vllm
def test_vllm_cpu_worker_still_names_shared_memory_from_the_init_method():
    """`unique_shm_ident` sets VLLM_DIST_IDENT inside the CPU worker's call of
    `init_worker_distributed_environment`, right after the worker set it from the init method
    (the same for every external-launcher engine on a machine)."""
    cpu_worker = pytest.importorskip("vllm.v1.worker.cpu_worker")
    source = inspect.getsource(cpu_worker)
    assert source.index('os.environ["VLLM_DIST_IDENT"]') < \
        source.index("init_worker_distributed_environment(\n")
    assert callable(cpu_worker.init_worker_distributed_environment)


@needs_vllm
def test_vllm_internals_the_shims_read_are_still_there():
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megarlhf.compat import vllm as vllm_shims

    assert "self.request_states" in inspect.getsource(OutputProcessor.__init__)  # drop_unfinished
    assert "self.kv_caches" in inspect.getsource(GPUModelRunner)  # kv_storages
    assert vllm_shims.VERSION.release[:2] == (0, 32)


def test_every_private_use_lives_in_compat():
    """Outside megarlhf/compat no module assigns to, or reads, another library's private
    module attributes (the patterns the shims use)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "megarlhf"
    private = re.compile(r"\b(ps|parallel_state|mrandom|cpu_worker|device_context)\._[A-Za-z]|"
                         r"\._set_main_param_and_optimizer_states|\bdef _postprocess\b|"
                         r"\btorch\.cuda\.[a-z_]+ = ")
    offenders = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py")
                 if "compat" not in path.parts
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if private.search(line)]
    assert offenders == []


def test_every_filtered_warning_is_still_one_its_library_emits():
    """compat/warnings.py filters by exact text: a filter whose text the library no longer
    emits hides nothing and should go. Literal texts are looked up in the library sources;
    the two built at run time are triggered."""
    import pathlib
    import warnings

    import megatron.core
    import torch.distributed
    from torch.distributed.checkpoint.utils import _api_bc_check

    from megarlhf.compat.warnings import KNOWN

    roots = [pathlib.Path(megatron.core.__file__).parent,
             pathlib.Path(torch.distributed.__file__).parent]
    sources = "\n".join(p.read_text(errors="replace") for root in roots
                        for p in root.rglob("*.py"))

    def load(state_dict, *, storage_reader=None):  # DCP's load, called as megatron-core 0.19
        return None                                  # calls it: two positional arguments

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _api_bc_check(load)({}, "dir")
        (torch.ones(1, requires_grad=True) * 2).grad  # a non-leaf tensor's .grad
    emitted = [str(w.message) for w in caught]
    missing = [start for _, start in KNOWN
               if start not in sources and not any(m.startswith(start) for m in emitted)]
    assert missing == []
