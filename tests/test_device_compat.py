"""The CPU compat layer redirects megatron-core's CUDA assumptions, and only those."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megarlhf.parallel import device, launch_local
from megarlhf.models.presets import preset
from tests import workers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="compat is for CPU machines")


def test_rewrites_are_confined_to_megatron_callers():
    assert device.apply_cpu_compat() is True
    # Our own code asking for CUDA on a CPU machine still fails loudly...
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    assert torch.ones(2).type() == "torch.FloatTensor"
    # ...while megatron-core's factory calls and type checks are redirected.
    from megatron.core.tensor_parallel import utils as mutils  # any megatron module namespace

    code = compile("torch.zeros(1, device='cuda').type()", mutils.__file__, "eval")
    assert eval(code, {"__name__": mutils.__name__, "torch": torch}) == "torch.cuda.FloatTensor"


def test_trace_lists_every_redirected_megatron_site():
    sites = launch_local(workers.traced_sites_of_a_step, 1, preset("tiny"))[0]
    assert sites, "a CPU train step must go through redirected sites"
    assert all(s.startswith("megatron/core/") for s in sites), sites
    kinds = {s.split(" ", 1)[1] for s in sites}
    # The known CUDA assumptions on the training path (see shared/DESIGN.md).
    assert "torch.cuda.current_device()" in kinds
    assert "Tensor.type()" in kinds  # grad clipping / distributed optimizer type checks
    assert any("schedules.py" in s for s in sites)


def test_device_context_still_works_after_compat():
    # The compat layer wraps torch factories; `with torch.device("meta")` must keep creating
    # meta tensors (meta-model building and transformers' from_pretrained rely on it). A fresh
    # interpreter, so no earlier use of device contexts can mask the fault.
    code = (
        "import torch\n"
        "from megarlhf.parallel.device import apply_cpu_compat\n"
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
