"""The built-in `python` tool: the model's code run in a sandbox, its output as the result.

Each call runs in bubblewrap (`bwrap`, the sandbox Flatpak uses) with every namespace of its
own (user, mount, PID, network, IPC, UTS, cgroup):
- files: a root holding /usr and the interpreter's prefix read-only (their site-packages
  hidden), the package directories the run lists (`packages`) read-only, an empty /tmp, the
  /proc of its own PID namespace, a minimal /dev, and its working directory (writable,
  removed afterwards). No other host file: not the project, the data, the checkpoints, the
  home directories or the host's /proc.
- processes: it sees and can signal only its own. When the call returns, however it
  returns, its PID namespace ends, and every process the program started with it.
- network: a loopback of its own, nothing else.
- limits: address space (`memory_mb`), CPU time and wall time (`timeout`), open files, file
  size and processes (set inside its user namespace, so counted there, not against the
  trainer's user); the output is cut at `output_bytes` (then to max_observation_tokens as
  any observation).
The kernel exempts root from the process limit, so under root the sandbox runs as nobody
(65534), its read-only directories bound from a private staging mount that nobody can reach
even where they lie under a home directory only root may enter.

It shares the host's kernel: a kernel exploit or a CPU side channel reaches beyond it
(docs/guides/multiturn.md). `check_sandbox` runs an escape probe before launch and refuses a
sandbox that leaks.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile

PYTHON = "python"
"""The built-in tool's name in `tools`."""
NOBODY = 65534
"""The uid and gid the sandbox runs as under root."""
MAX_PROCESSES = 64
"""Processes (threads included) one call may run at once, counted in its own namespace."""
MAX_OPEN_FILES = 256
MAX_FILE_MB = 64
"""The largest file the program may write."""

# Run inside the sandbox by the interpreter: the limits, then the program in a fresh
# interpreter (its own traceback, no launcher frames). -s: no user site-packages;
# PYTHONPATH holds only the listed packages.
_LAUNCH = """\
import os, resource as r, sys
for name, value in {limits!r}:
    r.setrlimit(getattr(r, name), (value, value))
os.execv(sys.executable, [sys.executable, "-s", "main.py"])
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


def _interpreter() -> tuple[str, str]:
    """(the base interpreter's binary, its prefix), past any virtual environment."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _package_dirs(prefix: str, listed: tuple[str, ...]) -> list[str]:
    """The interpreter's and the system's site-packages, hidden in the sandbox (but one that
    is, or holds, a directory the run lists)."""
    found = {sysconfig.get_path(kind, vars={"base": prefix, "platbase": prefix})
             for kind in ("purelib", "platlib")}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found |= {"/usr/lib/python3/dist-packages", f"/usr/local/lib/python{version}/dist-packages",
              f"/usr/local/lib/python{version}/site-packages"}
    return sorted(d for d in found if os.path.isdir(d)
                  and not any(_under(p, d) for p in listed))


class PythonSandbox:
    def __init__(self, *, timeout: float, memory_mb: int, output_bytes: int = 65536,
                 packages: tuple[str, ...] = ()):
        """`packages`: directories of Python packages the code may import (read-only)."""
        self.timeout, self.memory_mb, self.output_bytes = timeout, memory_mb, output_bytes
        self.packages = tuple(os.path.realpath(p) for p in packages)
        self.as_root = os.geteuid() == 0

    async def run(self, arguments: dict) -> tuple[str, bool]:
        """(output, failed) of the code in `arguments["code"]`."""
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            return (f"Error: python takes one argument, \"code\" (text); got "
                    f"{sorted(arguments)}", True)
        # Under root, nobody must reach the working directory and the staging mounts: both
        # in a directory of their own that anyone may enter, whatever the umask and TMPDIR.
        root = tempfile.mkdtemp(prefix="megarlhf-python-",
                                dir="/tmp" if self.as_root and os.path.isdir("/tmp") else None)
        work = os.path.join(root, "work")
        try:
            os.chmod(root, 0o711)
            os.mkdir(work)
            with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if self.as_root:
                os.chown(work, NOBODY, NOBODY)
                os.chown(os.path.join(work, "main.py"), NOBODY, NOBODY)
            return await self._execute(work)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def command(self, work: str) -> list[str]:
        """The command that runs `work`/main.py in the sandbox."""
        exe, prefix = _interpreter()
        limits = [("RLIMIT_AS", self.memory_mb * 2**20),
                  ("RLIMIT_CPU", max(1, round(self.timeout))),
                  ("RLIMIT_NOFILE", MAX_OPEN_FILES), ("RLIMIT_FSIZE", MAX_FILE_MB * 2**20),
                  ("RLIMIT_NPROC", MAX_PROCESSES)]
        shown = [d for d in (prefix, *self.packages) if not _under(d, "/usr")]
        # Under root, each read-only directory outside /usr comes from a staging mount
        # (source, staged): nobody may not be able to reach the original.
        stage = os.path.join(os.path.dirname(work), "stage")
        staged = {d: os.path.join(stage, str(i)) for i, d in enumerate(shown)} \
            if self.as_root else {d: d for d in shown}
        bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
                 "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "sbin", "lib", "lib64"):  # merged /usr; elsewhere a directory
            target = os.path.join("/", link)
            if os.path.islink(target):
                bwrap += ["--symlink", os.readlink(target), target]
            elif os.path.isdir(target):
                bwrap += ["--ro-bind", target, target]
        # Mounts in order, each on top of those before: the prefix, then the emptied
        # site-packages and /tmp, then the listed packages (which may lie in either).
        bwrap += ["--ro-bind", staged[prefix], prefix] if prefix in staged else []
        for d in _package_dirs(prefix, self.packages):
            bwrap += ["--tmpfs", d]
        bwrap += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for d in self.packages:
            bwrap += ["--ro-bind", staged.get(d, d), d]
        bwrap += ["--bind", work, "/work", "--chdir", "/work", "--clearenv",
                  "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work",
                  "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        if self.packages:
            bwrap += ["--setenv", "PYTHONPATH", os.pathsep.join(self.packages)]
        bwrap += [exe, "-s", "-c", _LAUNCH.format(limits=limits)]
        if not self.as_root:
            return bwrap
        # A private mount namespace holds the staging mounts (made here, anyone may enter
        # them); then nobody runs bwrap.
        for target in staged.values():
            os.makedirs(target, mode=0o755, exist_ok=True)
            os.chmod(target, 0o755)
            os.chmod(stage, 0o755)
        mounts = " && ".join(f"mount --bind {shlex.quote(source)} {shlex.quote(target)}"
                             for source, target in staged.items()) or "true"
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                f'{mounts} && exec "$@"', "stage", "setpriv", f"--reuid={NOBODY}",
                f"--regid={NOBODY}", "--clear-groups", *bwrap]

    async def _execute(self, work: str) -> tuple[str, bool]:
        proc = await asyncio.create_subprocess_exec(
            *self.command(work), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            start_new_session=True)
        try:
            try:
                output, cut = await asyncio.wait_for(self._read(proc), self.timeout)
                code = await asyncio.wait_for(proc.wait(), self.timeout) if not cut else None
            except asyncio.TimeoutError:
                return f"Error: the program did not finish within {self.timeout:g} s", True
        finally:  # bwrap's end ends the sandbox's PID namespace, and every process in it
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


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the escape probe ----------------------------------------------------------------------

_PROBE = """\
import os, signal, socket, subprocess
try:
    print("READ", open({secret!r}).read())
except OSError:
    pass
try:
    print("SEEN" if {token!r} in open("/proc/{pid}/cmdline").read() else "")
except OSError:
    pass
try:
    os.kill({pid}, signal.SIGKILL)
except OSError:
    pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
except OSError:
    pass
try:
    open({outside!r}, "w").write("x")
except OSError:
    pass
subprocess.Popen(["sleep", {token!r}], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("PROBED")
"""


def escape_probe(sandbox: PythonSandbox) -> tuple[list[str], str]:
    """(what leaked, the probe's output): a program in `sandbox` tries to read a file this
    process wrote outside it, see and kill a process this process started, connect to a
    socket this process listens on at 127.0.0.1, write outside its working directory and
    leave a process behind; each is checked here, on the host."""
    token = f"{4000 + secrets.randbelow(1000)}.{secrets.randbelow(10**9)}"
    outside = tempfile.mkdtemp(prefix="megarlhf-probe-")
    secret_path, written = os.path.join(outside, "secret"), os.path.join(outside, "written")
    secret = secrets.token_hex(16)
    with open(secret_path, "w") as f:
        f.write(secret)
    os.chmod(outside, 0o777)  # so that only the sandbox, not file modes, keeps it out
    os.chmod(secret_path, 0o644)
    host = subprocess.Popen(["sleep", token], stdin=subprocess.DEVNULL)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    try:
        code = _PROBE.format(secret=secret_path, token=token, pid=host.pid,
                             port=listener.getsockname()[1], outside=written)
        output, _ = asyncio.run(sandbox.run({"code": code}))
        leaks = []
        if "PROBED" not in output:
            leaks.append("the probe did not run")
        if secret in output:
            leaks.append(f"it read a file outside it ({secret_path})")
        if "SEEN" in output:
            leaks.append("it saw a process outside it")
        if host.poll() is not None:
            leaks.append("it killed a process outside it")
        try:
            listener.accept()[0].close()
            leaks.append("it connected to a socket on the host's 127.0.0.1")
        except BlockingIOError:
            pass
        if os.path.exists(written):
            leaks.append("it wrote outside its working directory")
        if _kill_left(token):
            leaks.append("a process it started outlived the call")
        return leaks, output
    finally:
        host.kill()
        host.wait()
        listener.close()
        shutil.rmtree(outside, ignore_errors=True)


def _kill_left(token: str) -> bool:
    """Whether a process other than ours runs `sleep token` (killed if so)."""
    found = False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", token.encode()] and int(pid) != os.getpid():
            parent = _parent(pid)
            if parent == os.getpid():  # the host's own sleep, started above
                continue
            found = True
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    return found


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def check_sandbox(sandbox: PythonSandbox | None = None) -> None:
    """ValueError in one line when the sandbox cannot run here, or lets a program out."""
    if shutil.which("bwrap") is None:
        raise ValueError("tools: python needs bubblewrap (`bwrap`; Debian and Ubuntu package "
                         "bubblewrap) to sandbox the code; it is not installed here")
    sandbox = sandbox or PythonSandbox(timeout=30, memory_mb=512)
    leaks, output = escape_probe(sandbox)
    if leaks == ["the probe did not run"]:
        last = output.strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"tools: python cannot sandbox code here ({last[0]}); bubblewrap "
                         f"needs unprivileged user namespaces (root runs it as nobody, so "
                         f"there too) and Linux 5.14+: run where they are allowed, or leave "
                         f"python out of tools")
    if leaks:
        raise ValueError(f"tools: the python sandbox leaks here: {'; '.join(leaks)}; leave "
                         f"python out of tools on this machine")
