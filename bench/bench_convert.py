"""HF <-> Megatron checkpoint conversion vs a plain read+write of the same bytes: time and memory.

A Llama-style fp32 model (default 254M parameters, 1.02 GB; hidden 1024, 16 layers, vocab
32000) is saved with transformers in 200 MB shards. Then each step below runs in a FRESH Python
process, so its peak RSS (`ru_maxrss`) is its own high-water mark:

  import floor        imports only (torch, transformers, safetensors, megatron.core, the
                      megarlhf converters): the RSS every other step starts from
  safetensors round   per shard: `safetensors.torch.load_file` (mmap), `save_file` elsewhere
  stream copy         per tensor: `readinto` its bytes into one reused buffer, `write` them
                      (header copied): a plain streamed read+write of the same bytes
  stream copy, fresh  the same with a new `bytearray` per tensor, as the converter's reader
  buffers             allocates (each 125 MiB allocation is page-faulted in anew)
  copyfile            `shutil.copyfile` per shard (kernel-side copy; the disk's floor)
  hf_to_mcore         `hf_to_mcore(hf, out, parallel=TP2xPP2)`
  mcore_to_hf         `mcore_to_hf(out, hf2)` with the default 2 GiB shards, and with shards of
                      the source's size
Diagnostics, to attribute the converters' time and memory (outputs discarded):
  setup               inspect + Megatron's meta-model template (gloo init), no tensor
  malloc threshold    MALLOC_MMAP_THRESHOLD_=1 MiB: glibc maps every large block and unmaps it
                      on free, instead of raising the threshold and keeping freed blocks in
                      its heap; what the per-layer blocks glibc keeps add to the peak
  CRC32 unchecked     mcore_to_hf without checking the CRC32 of what it reads (the check runs
                      in a thread beside the writes): what the check costs

Before every step the page cache is dropped (`echo 3 > /proc/sys/vm/drop_caches`, when the
process may), so every step reads its input cold; each step's time is its call plus an
`os.sync()` of what it wrote (hf_to_mcore fsyncs its files itself, the others do not).
Rounds interleave the steps; the table reports the median time, the largest peak RSS, and
speed ratios paired within a round (median over rounds), as other load drifts between rounds.
The outputs of the last round are checked bitwise against the source, outside the timings.

    python -m bench.bench_convert [--repeats 3] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from bench.report import append_entry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
# name -> (child call, output dir, reads the Megatron checkpoint, extra environment)
STEPS = {
    "safetensors round": ("safetensors round", "plain_st", False, {}),
    "stream copy": ("stream copy", "plain_stream", False, {}),
    "stream copy, fresh buffers": ("stream copy fresh", "plain_fresh", False, {}),
    "copyfile": ("copyfile", "plain_copy", False, {}),
    "hf_to_mcore": ("hf_to_mcore", "mcore", False, {}),
    "mcore_to_hf": ("mcore_to_hf", "hf2", True, {}),
    "mcore_to_hf, small shards": ("mcore_to_hf small", "hf2_small", True, {}),
    "diag: hf_to_mcore setup only": ("setup", None, False, {}),
    "diag: hf_to_mcore, malloc threshold": ("hf_to_mcore", "diag", False, FIXED_MMAP),
    "diag: mcore_to_hf, CRC32 unchecked": ("mcore_to_hf unchecked", "diag", True, {}),
}
PLAIN = ("safetensors round", "stream copy")
VERIFIED = ("mcore_to_hf", "mcore_to_hf, small shards", "safetensors round", "stream copy",
            "stream copy, fresh buffers", "copyfile")


# ---------------------------------------------------------------- child side (fresh process)

def _import_all():
    """The module set of every child, so the floor child's RSS is every child's start."""
    import megatron.core  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers

    import megarlhf.convert.hf_to_mcore  # noqa: F401
    import megarlhf.convert.mcore_to_hf  # noqa: F401
    from megarlhf.parallel.mesh import ParallelConfig  # noqa: F401

    transformers.AutoConfig, transformers.LlamaConfig  # resolve the lazy modules up front


def _vm(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _shards(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))


def _build(spec):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"], num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so the bitwise check sees them too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.save_pretrained(spec["src"], max_shard_size=f"{spec['shard_mb']}MB")


def _safetensors_round(src, dst):
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    for name in _shards(src):
        tensors = load_file(os.path.join(src, name))
        save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
        del tensors


def _stream_copy(src, dst, *, fresh: bool):
    os.makedirs(dst)
    buf = bytearray(0)
    for name in _shards(src):
        base, header = _header(os.path.join(src, name))
        with open(os.path.join(src, name), "rb") as fin, \
                open(os.path.join(dst, name), "wb") as fout:
            fout.write(fin.read(base))
            for info in sorted(header.values(), key=lambda i: i["data_offsets"][0]):
                start, end = info["data_offsets"]
                if fresh or len(buf) < end - start:
                    buf = bytearray(end - start)
                view = memoryview(buf)[:end - start]
                fin.seek(base + start)
                if fin.readinto(view) != end - start:
                    raise ValueError(f"{name} is truncated")
                fout.write(view)
                view.release()


def _copyfile(src, dst):
    os.makedirs(dst)
    for name in _shards(src):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def _setup(src, parallel):
    """hf_to_mcore's work before the first tensor: checks, and Megatron's meta-model template."""
    from megarlhf.convert.hf_to_mcore import inspect_hf
    from megarlhf.convert.mcore_io import checkpoint_template

    source = inspect_hf(src)
    source.model.check_parallel(parallel)
    checkpoint_template(source.model, value_head=False, dtype=source.dtype)


def _child(spec: dict) -> dict:
    step = spec["step"]
    if step == "build":
        _build(spec)
        return {}
    _import_all()
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from megarlhf.convert.mcore_to_hf import mcore_to_hf
    from megarlhf.parallel.mesh import ParallelConfig

    if step == "verify":
        return _verify(spec)
    parallel = ParallelConfig(tensor_parallel=spec["tp"], pipeline_parallel=spec["pp"])
    src, dst = spec["src"], spec.get("dst")
    calls = {
        "floor": lambda: None,
        "safetensors round": lambda: _safetensors_round(src, dst),
        "stream copy": lambda: _stream_copy(src, dst, fresh=False),
        "stream copy fresh": lambda: _stream_copy(src, dst, fresh=True),
        "copyfile": lambda: _copyfile(src, dst),
        "setup": lambda: _setup(src, parallel),
        "hf_to_mcore": lambda: hf_to_mcore(src, dst, parallel=parallel),
        "mcore_to_hf": lambda: mcore_to_hf(src, dst),
        "mcore_to_hf small": lambda: mcore_to_hf(src, dst,
                                                 max_shard_bytes=spec["shard_mb"] * 10**6),
        "mcore_to_hf unchecked": lambda: _unchecked(mcore_to_hf, src, dst),
    }
    before = _vm("VmRSS")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    calls[step]()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    os.sync()
    out = {"wall": wall, "sync": time.perf_counter() - t0, "peak": r1.ru_maxrss / 1024,
           "before": before, "user": r1.ru_utime - r0.ru_utime,
           "sys": r1.ru_stime - r0.ru_stime}
    return out


def _unchecked(convert, src: str, dst: str) -> None:
    from megarlhf.convert import mcore_io

    mcore_io.check_crc = lambda *args: None  # this child process only
    convert(src, dst)


def _verify(spec: dict) -> dict:
    """Bitwise: every source tensor equals the one of the same name in each output dir."""
    import torch
    from safetensors import safe_open

    def where(directory):
        out = {}
        for name in _shards(directory):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                out.update({key: os.path.join(directory, name) for key in f.keys()})
        return out

    src = where(spec["src"])
    report = {}
    for directory in spec["outputs"]:
        out = where(directory)
        bad = sorted(set(src) ^ set(out))
        for key in sorted(set(src) & set(out)):
            with safe_open(src[key], framework="pt") as f:
                a = f.get_tensor(key)
            with safe_open(out[key], framework="pt") as f:
                b = f.get_tensor(key)
            if a.dtype != b.dtype or a.shape != b.shape or \
                    not torch.equal(a.reshape(-1).view(torch.uint8),
                                    b.reshape(-1).view(torch.uint8)):
                bad.append(key)
        report[directory] = {"tensors": len(out), "bad": bad[:5], "n_bad": len(bad)}
    return report


# ---------------------------------------------------------------- parent side

def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _run_child(spec: dict, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_convert", "--child",
                           json.dumps(spec)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"step {spec['step']} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _model_stats(src: str) -> dict:
    params = nbytes = 0
    largest = ("", 0, None)
    for name in _shards(src):
        _, header = _header(os.path.join(src, name))
        for key, info in header.items():
            size = info["data_offsets"][1] - info["data_offsets"][0]
            numel = 1
            for d in info["shape"]:
                numel *= d
            params += numel
            nbytes += size
            if size > largest[1]:
                largest = (key, size, info["shape"])
    disk = sum(os.path.getsize(os.path.join(src, n)) for n in _shards(src))
    return {"params": params, "bytes": nbytes, "disk": disk, "shards": len(_shards(src)),
            "largest": largest}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=200)
    parser.add_argument("--workdir", help="kept afterwards; default: a fresh directory under "
                                          "/tmp, deleted at the end")
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(json.loads(args.child))), flush=True)
        return

    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    path = lambda key: os.path.join(work, key)  # noqa: E731
    base_spec = {"tp": 2, "pp": 2, "shard_mb": args.shard_mb}
    load = [os.getloadavg()[0]]
    try:
        t0 = time.perf_counter()
        _run_child({**base_spec, "step": "build", "src": path("hf"), "vocab": args.vocab,
                    "hidden": args.hidden, "intermediate": args.intermediate,
                    "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads})
        model = _model_stats(path("hf"))
        print(f"built {model['params'] / 1e6:.1f}M params, {model['disk'] / 1e9:.3f} GB on disk "
              f"in {model['shards']} shards ({time.perf_counter() - t0:.0f} s)", flush=True)

        def measure(name, call, out_key=None, reads_mcore=False, env=None):
            out = path(out_key) if out_key else None
            if out:
                shutil.rmtree(out, ignore_errors=True)
            dropped = _drop_caches()
            r = _run_child({**base_spec, "step": call, "src": path("mcore" if reads_mcore
                                                                  else "hf"),
                            "dst": out}, env)
            r["dropped"] = dropped
            print(f"  {name}: {r['wall']:.2f} s + sync {r['sync']:.2f} s (user {r['user']:.2f},"
                  f" sys {r['sys']:.2f}), peak RSS {r['peak']:.0f} MiB (before the call "
                  f"{r['before']:.0f})", flush=True)
            return r

        floors, results = [], {name: [] for name in STEPS}
        for rep in range(args.repeats):
            print(f"round {rep + 1}/{args.repeats}", flush=True)
            floors.append(measure("import floor", "floor"))
            for name, (call, out_key, reads_mcore, env) in STEPS.items():
                results[name].append(measure(name, call, out_key, reads_mcore, env))
            load.append(os.getloadavg()[0])
        shutil.rmtree(path("diag"), ignore_errors=True)
        mcore_bytes = _dir_bytes(path("mcore"))
        check = _run_child({"step": "verify", "src": path("hf"),
                            "outputs": [path(STEPS[n][1]) for n in VERIFIED]})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    for directory, r in check.items():
        print(f"verify {os.path.basename(directory)}: {r['tensors']} tensors, "
              f"{r['n_bad']} differ {r['bad']}")
    if any(r["n_bad"] for r in check.values()):
        raise SystemExit("an output differs from the source")

    floor = max(r["peak"] for r in floors)
    dropped = all(r["dropped"] for rs in [floors, *results.values()] for r in rs)
    size_mib = model["bytes"] / 2**20
    median = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731
    total = lambda r: r["wall"] + r["sync"]  # noqa: E731

    def speed_ratio(plain, rs):  # paired by round: the steps of one round ran minutes apart
        return statistics.median(total(p) / total(r) for p, r in zip(results[plain], rs))

    def row(name, rs):
        wall, peak = median(rs, total), max(r["peak"] for r in rs)
        timed = "setup" not in name
        cells = [name, f"{median(rs, lambda r: r['wall']):.2f}", f"{wall:.2f}",
                 f"{median(rs, lambda r: r['user']):.1f} / {median(rs, lambda r: r['sys']):.1f}",
                 f"{model['bytes'] / 1e9 / wall:.2f}" if timed else "",
                 *(f"{speed_ratio(p, rs):.2f}" if timed else "" for p in PLAIN),
                 f"{peak:.0f}", f"{peak - floor:.0f}", f"{(peak - floor) / size_mib:.2f}"]
        return "| " + " | ".join(cells) + " |"

    lines = [
        "| step | call (s, median) | call + sync (s) | user / sys CPU (s) | GB/s "
        "| speed / safetensors round | speed / stream copy | peak RSS (MiB, max) "
        "| peak - import floor (MiB) | delta / model size |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| import floor | | | | | | | {floor:.0f} | 0 | 0.00 |",
    ]
    lines += [row(name, rs) for name, rs in results.items()]
    table = "\n".join(lines)
    key, size, shape = model["largest"]
    notes = (
        f"Model: {model['params'] / 1e6:.1f}M params, {model['bytes'] / 1e9:.3f} GB of fp32 "
        f"tensors = {size_mib:.0f} MiB ({model['disk'] / 1e9:.3f} GB on disk in "
        f"{model['shards']} shards of <= {args.shard_mb} MB); largest tensor {key} "
        f"{shape} = {size / 2**20:.0f} MiB; small shards: max_shard_bytes = "
        f"{args.shard_mb} MB, the source's shard size; the Megatron checkpoint is "
        f"{mcore_bytes / 1e9:.3f} GB. Page cache dropped before every step: "
        f"{'yes' if dropped else 'no (not permitted): inputs were likely in the page cache'}. "
        f"1-minute load average during the run: {min(load):.1f} to {max(load):.1f}. "
        f"GB/s = model bytes / (call + sync); speed / X = X's time / the step's time, "
        f"median over rounds of the ratio within a round. hf_to_mcore and mcore_to_hf ran "
        f"without MALLOC_MMAP_THRESHOLD_ or any other allocator setting: they need none. "
        f"Verified bitwise against the source, outside the timings: "
        + ", ".join(f"{n} ({check[path(STEPS[n][1])]['tensors']} tensors)" for n in VERIFIED)
        + ".")
    print(table)
    print(notes)
    if args.append:
        append_entry(
            args.append,
            f"HF <-> Megatron conversion vs plain read+write of the same bytes, Llama-style "
            f"{model['params'] / 1e6:.0f}M fp32 ({args.layers} layers, hidden {args.hidden}, "
            f"vocab {args.vocab}), TP{base_spec['tp']}xPP{base_spec['pp']}",
            f"python -m bench.bench_convert --repeats {args.repeats}",
            table + "\n\n" + notes, machine_extra="local ext4 disk")

if __name__ == "__main__":
    main()
