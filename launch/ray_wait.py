"""Wait until a Ray cluster has NODES live nodes: `python ray_wait.py NODES TIMEOUT_S`.

Asks the cluster at RAY_ADDRESS (its GCS), which is what the controller's placement group
will see, rather than trusting that each `ray start` got through. Exit 0 once NODES are up,
1 with the count seen when TIMEOUT_S passes first.
"""

from __future__ import annotations

import os
import sys
import time

import ray


def main(want: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    address = os.environ["RAY_ADDRESS"]
    while True:  # the head may still be starting: connecting fails until its GCS is up
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            break
        except ConnectionError as e:
            if time.monotonic() > deadline:
                print(f"no Ray head at {address} after {timeout_s:.0f} s: {e}; see the head "
                      f"node's ray-*.log in the job's log directory", flush=True)
                return 1
            time.sleep(2)
    alive = 0
    while time.monotonic() < deadline:
        alive = sum(node["Alive"] for node in ray.nodes())
        if alive >= want:
            print(f"[{time.strftime('%H:%M:%S')}] ray: {alive}/{want} nodes up", flush=True)
            return 0
        time.sleep(1)
    print(f"ray: only {alive}/{want} nodes joined within {timeout_s:.0f} s; see the "
          f"ray-*.log files in the job's log directory", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2])))
