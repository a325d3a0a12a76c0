"""The Ray head's port, free on this node: `python ray_port.py PORT [--exact]`.

ppo.sbatch runs this on the head node just before `ray start --head`. Its default port
(40000 + job id % 10000) lies in the kernel's ephemeral range, from which every outgoing
connection and each of Ray's own ports taken at random (node manager, object manager, agents,
metrics) are drawn: another job's Ray, or what is left of an earlier run under the same job
id, can hold it. The head's GCS then cannot bind ("address already in use"; Ray 2.60's
`ray start` does not even exit) and the job waits for it until RAY_JOIN_TIMEOUT. So this
prints the first free port of PORT .. PORT + SEARCH - 1; with --exact (the user set RAY_PORT)
PORT or nothing. Exit 1, with a one-line message, when no port fits.
"""

from __future__ import annotations

import os
import socket
import sys

SEARCH = 100


def is_free(port: int) -> bool:
    """Whether the GCS could listen on PORT: bound as it binds (every interface, SO_REUSEADDR
    as gRPC sets it, so a closed connection still in TIME_WAIT does not count as holding it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
            sock.listen()
        except OSError:
            return False
    return True


def main(arg: str, exact: bool) -> int:
    port = int(arg) if arg.isdigit() else 0
    if not 0 < port < 65536:
        print(f"RAY_PORT={arg} is not a port number (1-65535)", file=sys.stderr)
        return 1
    candidates = [port] if exact else range(port, min(port + SEARCH, 65536))
    free = next((p for p in candidates if is_free(p)), None)
    if free is not None:
        print(free)
        return 0
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if exact:
        print(f"RAY_PORT={port} is in use on {host}: set RAY_PORT to a free port, or unset it "
              f"for ppo.sbatch to pick one", file=sys.stderr)
    else:
        print(f"no free port in {port}-{candidates[-1]} on {host} for the Ray head: set "
              f"RAY_PORT to a free port", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] == ["--exact"]))
