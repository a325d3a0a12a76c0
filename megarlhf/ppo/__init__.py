"""PPO trainer: config, worker, worker groups, controller loop, checkpoints, metrics."""
