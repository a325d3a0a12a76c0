"""The built-in `python` tool: the model's code run in a sandbox, its output as the result.

Each call runs `python -I` in a child process inside new user, mount and network namespaces
(`unshare`): every mount is read-only but for a private temporary directory (its working
directory, removed afterwards), there is no network but an unconnected loopback, the
address space is capped (`memory_mb`), CPU time and wall time are capped (`timeout`), and the
output is cut at `output_bytes` (then to max_observation_tokens as any observation). Where
namespaces cannot be made (a container that forbids them, no `unshare`), the tool is refused
before launch (`check_sandbox`).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile

PYTHON = "python"
"""The built-in tool's name in `tools`."""

# Inside the namespaces (as the namespace's root, which owns nothing outside it): make the
# work directory a mount of its own, every mount read-only, the work directory writable again;
# then the limits, and the interpreter.
_SETUP = r"""
set -e
dir="$1"; memory_kb="$2"; cpu_s="$3"; shift 3
mount --bind "$dir" "$dir"
awk '{print $5}' /proc/self/mountinfo | sort -r | while read -r point; do
  mount -o remount,bind,ro "$(printf '%b' "$point")" 2>/dev/null || true
done
mount -o remount,bind,rw "$dir"
cd "$dir"
ulimit -v "$memory_kb"
ulimit -t "$cpu_s"
exec "$@"
"""


def python(code: str) -> str:
    """Run a Python program and return what it prints (standard output and errors).

    Args:
        code: The program. Print what you want to see; nothing else is returned.
    """
    raise NotImplementedError("the python tool runs in PythonSandbox, not in-process")


def python_schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(python)


class PythonSandbox:
    def __init__(self, *, timeout: float, memory_mb: int, output_bytes: int = 65536):
        self.timeout, self.memory_mb, self.output_bytes = timeout, memory_mb, output_bytes

    async def run(self, arguments: dict) -> tuple[str, bool]:
        """(output, failed) of the code in `arguments["code"]`."""
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            return (f"Error: python takes one argument, \"code\" (text); got "
                    f"{sorted(arguments)}", True)
        work = tempfile.mkdtemp(prefix="megarlhf-python-")
        try:
            with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            return await self._execute(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def command(self, work: str) -> list[str]:
        return ["unshare", "--user", "--map-root-user", "--mount", "--net", "--fork",
                "sh", "-c", _SETUP, "sandbox", work, str(self.memory_mb * 1024),
                str(math.ceil(self.timeout)), sys.executable, "-I", "main.py"]

    async def _execute(self, work: str) -> tuple[str, bool]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work,
               "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            *self.command(work), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            output, cut = await asyncio.wait_for(self._read(proc), self.timeout)
            code = await asyncio.wait_for(proc.wait(), self.timeout) if not cut else None
        except asyncio.TimeoutError:
            _kill(proc)
            await proc.wait()
            return f"Error: the program did not finish within {self.timeout:g} s", True
        if cut:
            _kill(proc)
            await proc.wait()
        text = output.decode("utf-8", errors="replace")
        if cut:
            return text + f"\n[output cut at {self.output_bytes} bytes]", True
        if code != 0:
            return text + f"\n[exit code {code}]", True
        return text, False

    async def _read(self, proc) -> tuple[bytes, bool]:
        data = b""
        while len(data) <= self.output_bytes:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                return data, False
            data += chunk
        return data[:self.output_bytes], True


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def check_sandbox() -> None:
    """ValueError with the reason when the sandbox cannot run here."""
    if shutil.which("unshare") is None:
        raise ValueError("tools: python needs `unshare` (util-linux) to sandbox the code; it "
                         "is not installed here")
    sandbox = PythonSandbox(timeout=30, memory_mb=512)
    output, failed = asyncio.run(sandbox.run({"code": "print(6 * 7)"}))
    if failed or output.strip() != "42":
        raise ValueError(f"tools: python cannot sandbox code here (user, mount and network "
                         f"namespaces via unshare): {output.strip().splitlines()[-1:] or output}"
                         f"; run where namespaces are allowed, or leave python out of tools")
