"""A teacher on vLLM engines (teacher_backend=vllm): its logprobs of a batch's tokens in the
frame PolicyRole.logprobs gives a Megatron teacher's, so the experience pass treats both alike.

vLLM scores given ids as prompt logprobs (VLLMEngine.score), of raw logits: what a trainer's
forward computes. The engines span `tensor_parallel` consecutive ranks of the teachers' group;
the group's rows are dealt over them and each engine's results gathered once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.data.sequences import SequenceBatch


class VLLMTeacher:
    def __init__(self, engine, *, rank: int, world_size: int, tensor_parallel: int,
                 device: torch.device):
        """`engine`: this rank's VLLMEngine (of `tensor_parallel` ranks); `rank`,
        `world_size`: in the group, whose default process group gathers the results."""
        self.engine, self.device = engine, device
        self.share, self.engines = rank // tensor_parallel, world_size // tensor_parallel
        # An engine's ranks all hold its results: its first rank speaks for it.
        self.speaks = rank % tensor_parallel == 0

    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """log p(token_t | tokens_<t) [B, T] at the response tokens (0 elsewhere), on every
        rank. A row's real tokens (attention_mask) are its sequence: an episode's observation
        tokens are context, read but not scored (the response mask leaves them out)."""
        real = batch.attention_mask.bool().cpu()
        tokens = batch.tokens.cpu()
        mine = [i for i in range(batch.shape[0]) if i % self.engines == self.share]
        scores = self.engine.score([tokens[i][real[i]].tolist() for i in mine]) if mine else []
        local = list(zip(mine, scores)) if self.speaks else []
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        out = torch.zeros(batch.shape)
        rows = [pair for part in parts for pair in part]
        if sorted(i for i, _ in rows) != list(range(batch.shape[0])):
            raise RuntimeError(f"the teacher's engines scored rows {sorted(i for i, _ in rows)}"
                               f" of {batch.shape[0]}")
        for i, values in rows:
            # Column c holds the logprob of token c, after the row's first real token.
            out[i, real[i].nonzero().flatten()[1:]] = torch.tensor(values)
        out = torch.where(batch.response_mask.bool().cpu(), out, 0)
        return out.to(self.device)

    def shutdown(self) -> None:
        self.engine.shutdown()
