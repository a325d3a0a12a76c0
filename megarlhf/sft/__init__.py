"""Supervised fine-tuning (sft.py), a pairwise reward model (rm.py) and offline preference
optimization (dpo.py: DPO, IPO, SimPO) on the Megatron engine, sharing one training loop
(loop.py: eval, checkpoints, resume, metrics, HF export). Configs: config.py, loaded from YAML
by megarlhf/configio.py. Entry points are plain functions, `run_sft(cfg)` / `run_rm(cfg)` /
`run_dpo(cfg)`, called on every rank (torchrun, srun, or `launch_local(run_sft, n, cfg)`)."""
