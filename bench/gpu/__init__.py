"""GPU benchmark: everything only a GPU can show, in one command.

    python -m bench.gpu [--dry-run] [--append BENCHMARKS.md] [--peak-tflops T]

1. bf16 training MFU of the `llama-1b` preset at sequence length 4096 (SDPA layer spec, and
   Transformer Engine's when it imports);
2. fp32 parity of one training step on GPU against the same step on CPU;
3. generation tokens/s of the Megatron rollout engine (and of vLLM when it imports);
4. the weight bridge's sync bandwidth next to a plain device-to-device `copy_`.

Needs only torch and megatron-core; what cannot run is skipped with the reason. `--dry-run`
runs every measurement at a tiny size on CPU (no GPU needed) to check the setup.

Modules: plan (what runs, at what size, and why something is skipped), mfu, parity, rollout,
bridge (one measurement each), common (helpers they share), __main__ (the command).
"""
