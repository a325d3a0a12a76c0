"""Compare an HF model with a Megatron checkpoint on the same tokens (with images for a
vision-language model) against HF's float64 forward (see megarlhf.convert.verify); exits 1
when ours is neither within the tolerance of it nor about as close to it as HF's own fp32
forward (HF_FP32_FACTOR times its difference)."""

from __future__ import annotations

import argparse

from tools.convert_hf import run


def main(argv=None) -> int:
    from megarlhf.convert.verify import DEFAULT_TOLERANCE, HF_FP32_FACTOR

    p = argparse.ArgumentParser(prog="python -m tools.convert_hf.verify", description=__doc__)
    p.add_argument("--hf", required=True, help="HF model directory")
    p.add_argument("--ckpt", required=True, help="Megatron checkpoint directory")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size (mixture-of-experts models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor parallel size (default: 1 with --ep > 1, else TP)")
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="max |logit| (or score) difference from HF's float64 forward allowed; "
                        f"ours also passes within {HF_FP32_FACTOR:g}x HF's own fp32 difference")
    args = p.parse_args(argv)

    from megarlhf.convert.verify import verify
    from megarlhf.parallel.mesh import ParallelConfig

    parallel = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp,
                              virtual_pipeline_parallel=args.vpp, expert_parallel=args.ep,
                              expert_tensor_parallel=args.etp)
    report = verify(args.hf, args.ckpt, parallel, batch=args.batch, seq_len=args.seq_len,
                    seed=args.seed, tolerance=args.tolerance)
    print(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    run(main)
