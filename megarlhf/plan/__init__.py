"""The memory planner behind `megarlhf plan`: exact per-rank parameter counts, bytes per GPU
for every role, term and phase of a PPO job (with its offload, engine sleep, sequence
parallelism and recomputation settings), pinned host memory per node, and the checks that
refuse a job before it queues."""
