"""The memory planner behind `megarlhf plan`: exact per-rank parameter counts, bytes per GPU
for every role and phase of a PPO job, and the checks that refuse a job before it queues."""
