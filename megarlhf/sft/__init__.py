"""Stages 1 and 2 of InstructGPT-style alignment on the Megatron engine: supervised
fine-tuning (sft.py) and a pairwise reward model (rm.py), sharing one training loop (loop.py:
eval, checkpoints, resume, metrics, HF export). Configs: config.py, loaded from YAML by
megarlhf/configio.py. Entry points are plain functions, `run_sft(cfg)` / `run_rm(cfg)`, called on every
rank (torchrun, srun, or `launch_local(run_sft, n, cfg)`)."""
