"""HF checkpoint -> Megatron dist checkpoint (see megarlhf.convert.hf_to_mcore)."""

from __future__ import annotations

import argparse

from tools.convert_hf import run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.convert_hf.hf_to_mcore",
                                description=__doc__)
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="Megatron checkpoint directory to create")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size it will train at")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size it will train at")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size (mixture-of-experts models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor parallel size (default: 1 with --ep > 1, else TP)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--role", default="actor", help="actor | ref | critic | reward")
    p.add_argument("--init-value-head", action="store_true",
                   help="critic/reward from a causal LM: start the value head fresh")
    p.add_argument("--seed", type=int, default=0, help="seed of a fresh value head")
    p.add_argument("--vocab-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)

    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from megarlhf.parallel.mesh import ParallelConfig

    parallel = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp,
                              virtual_pipeline_parallel=args.vpp, expert_parallel=args.ep,
                              expert_tensor_parallel=args.etp)
    meta = hf_to_mcore(args.hf, args.out, parallel=parallel, role=args.role,
                       init_value_head=args.init_value_head, seed=args.seed, force=args.force,
                       make_vocab_size_divisible_by=args.vocab_divisible_by)
    print(f"wrote {args.out}: {meta['architecture']} {args.role}, {meta['dtype']}, "
          f"loadable at any layout (checked for TP{args.tp}xPP{args.pp}"
          f"{f'xEP{args.ep}' if args.ep > 1 else ''}{f'xETP{args.etp}' if args.etp else ''})")
    return 0


if __name__ == "__main__":
    run(main)
