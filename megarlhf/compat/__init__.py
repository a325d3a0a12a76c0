"""Everything megarlhf does to, or through the private parts of, another library: one module
per library, each naming the versions it was written for and refusing others with one line.

- `megatron`: megatron-core's CUDA assumptions redirected on CPU machines, its distributed
  optimizer's load over torch's Adam, its dist-checkpoint load through torch's current DCP
  call (0.16 and 0.17 call a deprecated one), the value head's hook into GPTModel's forward.
- `vllm`: vLLM's teardown kept off the trainer's process group, unique shared-memory names for
  engines on CPU, tied layers refreshed after a weight reload, the reload finished after a
  failure.
- `warnings`: the third-party warnings every run prints and no user can act on, filtered by
  exact message.

Each shim has a test in tests/test_compat.py that fails when the upstream behaviour it works
around changes, so an upgrade shows which shim to revisit.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class UnsupportedVersion(ImportError, ValueError):
    """An installed library outside the versions a shim was written for. A ValueError too,
    so every command reports it as the one line it is (megarlhf.errors.run_command), before
    any rank starts: the launching process imports the shims with the mesh code."""


def require(library: str, installed: str, supported: str, *, install: str) -> Version:
    """The installed `library` version; UnsupportedVersion unless it is in `supported` (a PEP
    440 specifier such as ">=0.16.1,<0.20"). `install` says how to get a supported one."""
    version = Version(installed)
    if not SpecifierSet(supported).contains(version, prereleases=True):
        raise UnsupportedVersion(f"{library} {installed} is installed; megarlhf supports "
                                 f"{library}{supported}: {install}")
    return version
