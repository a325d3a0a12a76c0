"""Megatron dist checkpoint (any layout) -> HF safetensors (see megarlhf.convert.mcore_to_hf)."""

from __future__ import annotations

import argparse

from tools.convert_hf import run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.convert_hf.mcore_to_hf",
                                description=__doc__)
    p.add_argument("--ckpt", required=True, help="Megatron checkpoint directory")
    p.add_argument("--out", required=True, help="HF directory to create")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: the checkpoint's)")
    p.add_argument("--arch", default=None,
                   help="llama | mistral | qwen2 | qwen3, for checkpoints not converted from HF")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--lora", default="merged", choices=["merged", "adapter"],
                   help="a checkpoint with LoRA adapters: the model with them merged, or a "
                        "PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) over its base")
    p.add_argument("--base", default=None,
                   help="a LoRA run's checkpoint holds only its adapters: where the base "
                        "checkpoint it trained over is now, if it moved from the path the "
                        "checkpoint records")
    args = p.parse_args(argv)

    from megarlhf.convert.mcore_to_hf import mcore_to_hf

    out = mcore_to_hf(args.ckpt, args.out, dtype=args.dtype, force=args.force,
                      arch_name=args.arch, max_shard_bytes=int(args.max_shard_gb * 1024**3),
                      lora=args.lora, base=args.base)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
