"""The four PPO roles over TrainEngine: policy (actor / reference) and value (critic / reward).

A role can be driven in-process (tests, single-process debugging) or from a Ray worker; every
rank of the role's mesh calls the same method with the same global batch, and results come
back as global [B, ...] tensors on every rank.
"""
