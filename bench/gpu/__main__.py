"""The command: print the plan, run what this machine can, print (and append) one table.

    python -m bench.gpu [--dry-run] [--only KEYS] [--append BENCHMARKS.md] [--peak-tflops T]

A GPU run gives every measurement a fresh process (launch_local, one rank): its own CUDA
context and allocator, so one measurement's memory and warm caches never bias the next; the
CPU side of the parity check runs where the GPU is hidden. A dry run calls the same functions
in this process instead, since each fresh process would cost seconds of imports on a CPU.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback

# A dry run is a CPU run even on a GPU machine: hide the GPU before anything asks torch.
if "--dry-run" in sys.argv[1:]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from bench.gpu import plan  # noqa: E402  (after hiding the GPU)

TITLE = "GPU benchmark: training MFU, CPU/GPU parity, generation tokens/s, bridge sync"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=TITLE)
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU needed: check the setup and run every measurement at a "
                             "tiny size on CPU")
    parser.add_argument("--append", metavar="FILE",
                        help="append the results as one entry to this markdown file")
    parser.add_argument("--only", metavar="KEYS",
                        help="comma-separated measurements to run (of: "
                             + ", ".join(item.key for item in plan.ITEMS) + "); default all")
    parser.add_argument("--peak-tflops", type=float,
                        help="the GPU's peak dense bf16 TFLOPs for MFU (default: from the "
                             "GPU's name: H100 SXM and H200 989)")
    return parser.parse_args(argv)


def _runner(dry_run: bool):
    """How a measurement function runs: here (dry run) or in a fresh one-rank process."""
    from megarlhf.parallel import launch_local
    from megarlhf.parallel.mesh import free_port

    if dry_run:
        # The torchrun-style variables launch_local gives each rank: the rendezvous, and
        # vLLM's external launcher, read them.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

    def run(fn, *args, env: dict[str, str] | None = None):
        if dry_run:
            return fn(*args)
        return launch_local(fn, 1, *args, env=env, timeout_s=900)[0]

    return run


def _peak(args, machine: plan.Machine):
    """((TFLOPs, what), None) or (None, why MFU is not computed)."""
    from bench.gpu.mfu import peak_for

    if args.dry_run:
        return None, "dry run on CPU"
    if not machine.cuda:
        return None, "no GPU"
    if args.peak_tflops:
        return (args.peak_tflops, "--peak-tflops"), None
    found = peak_for(machine.gpu_name)
    if found is None:
        return None, f"unknown GPU {machine.gpu_name!r}; pass --peak-tflops"
    return found, None


def _measure(item: plan.Item, sizes: plan.Sizes, run, peak, no_peak: str):
    from bench.gpu import bridge, mfu, offload, parity, ppo, rl_phase, rollout

    if item.key == "mfu-sdpa":
        return mfu.measure(sizes, run, "sdpa", peak, no_peak)
    if item.key == "mfu-te":
        return mfu.measure(sizes, run, "te", peak, no_peak)
    if item.key == "parity":
        return parity.measure(sizes, run)
    if item.key == "gen-megatron":
        return rollout.measure(sizes, run, "megatron")
    if item.key == "gen-vllm":
        return rollout.measure(sizes, run, "vllm")
    if item.key == "ppo":
        return ppo.measure(sizes, run)
    if item.key == "offload":
        return offload.measure(sizes, run)
    if item.key == "rl-phase":
        return rl_phase.measure(sizes, run, peak, no_peak)
    if item.key == "profile":
        return ppo.measure_profile(sizes, run)
    return bridge.measure(sizes, run)


def _summary(e: Exception) -> str:
    """One line for the table (the full traceback went to stderr). A rank's failure carries
    its traceback as the message: its last line names the exception."""
    from megarlhf.parallel import RankError

    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    return lines[-1].strip() if isinstance(e, RankError) else f"{type(e).__name__}: {lines[0]}"


def _table(rows) -> str:
    lines = ["| measurement | setting | result |", "|---|---|---|"]
    return "\n".join(lines + [f"| {m} | {s} | {r} |" for m, s, r in rows])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    chosen = plan.ITEMS
    if args.only:
        keys = args.only.split(",")
        unknown = sorted(set(keys) - {item.key for item in plan.ITEMS})
        if unknown:
            print(f"--only: unknown measurement(s) {unknown}; choose from "
                  f"{[item.key for item in plan.ITEMS]}", file=sys.stderr)
            return 2
        chosen = tuple(item for item in plan.ITEMS if item.key in keys)
    machine = plan.Machine.detect()
    sizes = plan.DRY if args.dry_run else plan.FULL
    skip = plan.dry_skip if args.dry_run else plan.gpu_skip
    mode = "DRY RUN (CPU, tiny sizes: checks the setup; the numbers are not GPU results)" \
        if args.dry_run else "GPU run"
    print(f"{TITLE}\n{mode}\nmachine: {machine.describe()}")
    if not args.dry_run and not machine.cuda:
        print("nothing here needs measuring without a GPU; --dry-run checks the setup on CPU")
    print("plan:")
    for item in chosen:
        on_gpu = plan.gpu_skip(item, machine)
        line = f"  {item.title}: GPU run here: {'runs' if on_gpu is None else 'skip: ' + on_gpu}"
        if args.dry_run:
            reason = plan.dry_skip(item, machine)
            line += f"; dry run: {'runs on CPU' if reason is None else 'skip: ' + reason}"
        print(line)
    from bench.gpu.mfu import FORMULA
    from bench.gpu.parity import TOLERANCE

    peak, no_peak = _peak(args, machine)
    notes = [f"MFU: {FORMULA}; peak: "
             + (f"{peak[0]:.0f} TFLOPs ({peak[1]})" if peak else f"not computed: {no_peak}"),
             f"Parity tolerance: {TOLERANCE}"]
    print("\n".join(notes), flush=True)

    run = _runner(args.dry_run)
    rows, failed, measured = [], False, False
    started = time.perf_counter()
    for item in chosen:
        reason = skip(item, machine)
        if reason is not None:
            rows.append((item.title, "", f"skipped: {reason}"))
            continue
        t0 = time.perf_counter()
        try:
            new = _measure(item, sizes, run, peak, no_peak)
        except Exception as e:  # noqa: BLE001 - one broken measurement must not hide the rest
            traceback.print_exc()
            failed = True
            new = [("", "", f"FAILED: {_summary(e)}")]
        measured = True
        failed |= any(r.startswith("FAIL") for _, _, r in new)
        rows += [(f"{item.title}: {part}" if part else item.title, setting, result)
                 for part, setting, result in new]
        print(f"  done: {item.title} ({time.perf_counter() - t0:.1f} s)", flush=True)

    table = _table(rows)
    print(f"\n{'DRY RUN - ' if args.dry_run else ''}results "
          f"({time.perf_counter() - started:.1f} s):\n{table}")
    if args.append:
        if not measured:
            print(f"not appended to {args.append}: nothing was measured")
        else:
            from bench.report import append_entry

            command = "python -m bench.gpu " + shlex.join(sys.argv[1:] if argv is None else argv)
            body = "\n\n".join(notes) + f"\n\n{table}"
            append_entry(args.append, ("DRY RUN (CPU, tiny sizes): " if args.dry_run else "")
                         + TITLE, command.strip(), body,
                         machine_extra=machine.gpu_name or "no GPU")
            print(f"appended to {args.append}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
