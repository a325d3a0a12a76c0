"""Micro-batches of the PPO roles (megarlhf/roles/batching.py) without a model: which rows go
together, the packed layout, and the way back to the global batch's frame.

A stand-in model checks the layouts: its output at a position is a hash of the (token,
position) pairs that position may attend to under the micro-batch's attention mask. Equal
outputs mean equal model inputs as far as any causal model can tell, so the packed and
trimmed layouts must reproduce the padded reference exactly (integer arithmetic, no
tolerance).
"""

from __future__ import annotations

import types

import pytest
import torch

from megarlhf.data.packing import document_mask
from megarlhf.data.sequences import SequenceBatch
from megarlhf.roles.batching import (
    Batching, about_token, at_last_token, balance, fit, microbatches, spans,
)
from tests.role_workers import experience_batch


def _engine(dp_size=1, dp_rank=0, tp=1, sequence_parallel=False, layer_spec="local",
            experts=None):
    return types.SimpleNamespace(
        spec=types.SimpleNamespace(
            layer_spec=layer_spec, model=types.SimpleNamespace(
                max_position_embeddings=64, num_layers=3, moe_router_topk=2,
                hidden_size=64, num_attention_heads=4, num_experts=experts),
            transformer=types.SimpleNamespace(tensor_model_parallel_size=tp,
                                              sequence_parallel=sequence_parallel,
                                              context_parallel_size=1)),
        mesh=types.SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank))


def _stand_in_model(mb: dict) -> torch.Tensor:
    """[R, L] int64: per query, a sum over the keys it may see of a hash of their (token,
    position) and of the query-key offset RoPE would rotate by (columns, or the shared-prompt
    layout's `rotary_columns`), plus its own: a wrong mask, position, offset or token
    changes it."""
    pair = mb["tokens"] * 1009 + mb["position_ids"] * 7 + 1  # [R, L]
    visible = ~document_mask(mb["document_ids"], shared=mb.get("shared_prompt"))[:, 0]
    rotary = mb.get("rotary_columns", torch.arange(mb["tokens"].shape[1]))
    offset = rotary[:, None] - rotary[None, :]  # [Lq, Lk]
    keys = pair * (mb["position_ids"] + 3)
    return (visible * keys[:, None, :] * (offset + 5)).sum(-1) * 31 + pair * 17


def _reference(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = batch.model_inputs()
    mb = {**inputs, "token_index": torch.where(
        batch.attention_mask.bool(),
        torch.arange(batch.tokens.numel()).view(batch.shape), -1)}
    out = _stand_in_model(mb)
    return about_token(mb, out), at_last_token(mb, out)


def _assemble(batch: SequenceBatch, batching: Batching, dp: int, **engine_kw):
    per_token = torch.zeros(batch.shape, dtype=torch.long)
    score = torch.zeros(batch.shape[0], dtype=torch.long)
    seen = []
    for rank in range(dp):
        mbs = microbatches(_engine(dp, rank, **engine_kw), batching, batch,
                           response_mask=batch.response_mask.float())
        for mb in mbs:
            out = _stand_in_model(mb)
            rows, c0 = mb["rows"], int(mb["col0"])
            per_token[rows, c0:c0 + mb["token_index"].shape[1]] = about_token(mb, out)
            score[rows] = at_last_token(mb, out)
            seen += rows.tolist()
            torch.testing.assert_close(mb["response_mask"],
                                       batch.response_mask[rows, c0:c0 + mb["token_index"]
                                                           .shape[1]].float())
    assert sorted(seen) == list(range(batch.shape[0]))  # every row once
    return per_token, score


def _samples_batch() -> SequenceBatch:
    """8 rows, the samples of 3 prompts (3, 3, 2 rows: the second group straddles the DP
    ranks' halves), one response with a token of another party inside (a tool's output in a
    multi-turn episode: real, not a response token). Under sequence parallelism, rows 4-7
    share prompts two by two; the other micro-batches keep a row per sample."""
    batch = experience_batch(300, rows=9, seed=3, columns=13, samples=3)
    keep = [0, 1, 2, 3, 4, 5, 6, 7]
    response = batch.response_mask[keep].clone()
    assert response[7, 8:11].tolist() == [1, 1, 1]
    response[7, 9] = 0  # in the micro-batches that share prompts below
    return SequenceBatch(tokens=batch.tokens[keep], attention_mask=batch.attention_mask[keep],
                         response_mask=response)


@pytest.mark.parametrize("batching,dp,engine_kw", [
    (Batching(2), 2, {}),
    (Batching(max_tokens=40), 2, {}),
    (Batching(max_tokens=24, pack=True), 2, {}),
    (Batching(max_tokens=24, pack=True), 1, dict(tp=2, sequence_parallel=True)),
    (Batching(1, share_prompts=True), 2, {}),
    (Batching(2, share_prompts=True), 1, dict(tp=2, sequence_parallel=True)),
    (Batching(max_tokens=40, share_prompts=True), 2, {}),
    (Batching(max_tokens=32, share_prompts=True), 1, dict(tp=2, sequence_parallel=True)),
], ids=["count", "budget-padded", "budget-packed-dp2", "packed-sp", "shared-dp2",
        "shared-sp", "budget-shared-dp2", "budget-shared-sp"])
def test_layouts_reproduce_the_padded_batch(batching, dp, engine_kw):
    batch = _samples_batch()
    want_tokens, want_score = _reference(batch)
    got_tokens, got_score = _assemble(batch, batching, dp, **engine_kw)
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(got_score, want_score)


@pytest.mark.parametrize("batching,engine_kw", [
    (Batching(2), {}),
    (Batching(max_tokens=40), {}),
    (Batching(max_tokens=24, pack=True), dict(tp=2, sequence_parallel=True)),
], ids=["count", "budget-padded", "budget-packed-sp"])
def test_routing_is_laid_out_as_the_model_positions(batching, engine_kw):
    """An expert routing [B, T, layers, k] reaches each micro-batch as [R, L, layers, k]:
    at the model position of every real token, that token's routing (found by its token id
    and position in the model's inputs, not through token_index); -1 at padding."""
    batch = experience_batch(300, rows=8, seed=3, columns=17)
    B, T = batch.shape
    code = (torch.arange(B)[:, None] * 100 + torch.arange(T)).to(torch.int16)  # (row, col)
    routing = torch.where(batch.attention_mask.bool(), code, -1)[..., None, None].expand(
        B, T, 3, 2)
    positions = batch.position_ids()
    seen = 0
    for rank in range(2):
        # routing codes up to 1023
        engine = _engine(2, rank, experts=1024, **engine_kw)
        for mb in microbatches(engine, batching, batch, routing):
            got = mb["routing"]
            assert got.shape == (*mb["tokens"].shape, 3, 2)
            assert torch.equal(got, got[..., :1, :1].expand_as(got))  # per token, all layers
            for (i, j), value in zip(torch.ones_like(mb["tokens"]).nonzero().tolist(),
                                     got[..., 0, 0].flatten().tolist()):
                if value == -1:
                    continue
                row, col = divmod(value, 100)
                assert (int(mb["tokens"][i, j]), int(mb["position_ids"][i, j])) == (
                    int(batch.tokens[row, col]), int(positions[row, col]))
                seen += 1
    assert seen == int(batch.attention_mask.sum())  # every real token once


def test_a_routing_that_does_not_fit_the_model_is_refused():
    batch = experience_batch(300, rows=2, seed=3, columns=17)
    wrong_layers = torch.zeros(2, 17, 2, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"needs \[B, T, layers, k\] = \[2, 17, 3, 2\]"):
        microbatches(_engine(experts=1024), Batching(), batch, wrong_layers)
    no_such_expert = torch.full((2, 17, 3, 2), 1024, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"names experts \[1024, 1024\]; this model has 1024"):
        microbatches(_engine(experts=1024), Batching(), batch, no_such_expert)


def test_micro_batches_by_count_keep_the_batch_width():
    """One shape for every micro-batch (the pipeline needs no shape exchange), as before
    token budgets existed."""
    batch = experience_batch(300, rows=8, seed=3, columns=17)
    mbs = microbatches(_engine(dp_size=2, dp_rank=1), Batching(2), batch)
    assert [mb["rows"].tolist() for mb in mbs] == [[4, 5], [6, 7]]
    assert {tuple(mb["tokens"].shape) for mb in mbs} == {(2, 17)}
    assert all(int(mb["col0"]) == 0 for mb in mbs)


def test_packed_micro_batch_layout():
    batch = SequenceBatch(tokens=torch.tensor([[0, 5, 6, 7, 0], [8, 9, 0, 0, 0]]),
                          attention_mask=torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]),
                          response_mask=torch.tensor([[0, 0, 0, 1, 0], [0, 1, 0, 0, 0]]))
    # 5 tokens, padded to 6 for sequence parallelism at TP2.
    (mb,) = microbatches(_engine(tp=2, sequence_parallel=True),
                         Batching(max_tokens=100, pack=True), batch)
    assert mb["tokens"].tolist() == [[5, 6, 7, 8, 9, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert mb["labels"].tolist() == [[6, 7, 0, 9, 0, 0]]  # no label across sequences
    allowed = ~document_mask(mb["document_ids"])[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False]
    assert allowed[5].tolist() == [False] * 5 + [True]  # padding sees only itself
    # Columns 0-3 of the batch: column 4 is padding in both rows.
    assert mb["col0"] == 0 and mb["token_index"].tolist() == [[-1, 0, 1, 2], [3, 4, -1, -1]]


def test_token_budget_balances_tokens_over_dp_and_fits_the_budget():
    batch = experience_batch(300, rows=16, seed=5, columns=40)
    first, end = spans(batch)
    lengths = end - first
    parts = balance(lengths, 2)
    loads = [int(lengths[p].sum()) for p in parts]
    assert abs(loads[0] - loads[1]) <= int(lengths.max())  # longest-first greedy's bound
    for pack, cost in ((True, lambda f, e: sum(e) - sum(f)),
                       (False, lambda f, e: len(f) * (max(e) - min(f)))):
        def span_cost(span):  # the same cost, from a micro-batch's running Span
            return span.tokens if pack else span.rows * (span.end - span.first)

        groups = fit(parts[0], first, end, 60, span_cost)
        assert sorted(r for g in groups for r in g) == parts[0]
        assert all(cost([int(first[r]) for r in g], [int(end[r]) for r in g]) <= 60
                   for g in groups)


def test_budget_mistakes_are_named():
    batch = experience_batch(300, rows=4, seed=1, columns=17)
    longest = int((spans(batch)[1] - spans(batch)[0]).max())
    with pytest.raises(ValueError, match="does not fit max_tokens_per_micro_batch"):
        microbatches(_engine(), Batching(max_tokens=longest - 1), batch)
    with pytest.raises(ValueError, match="cannot feed 8 DP ranks"):
        microbatches(_engine(dp_size=8), Batching(max_tokens=100), batch)
    with pytest.raises(ValueError, match="not both"):
        Batching(2, max_tokens=10)
    with pytest.raises(ValueError, match="packing needs a token budget"):
        Batching(pack=True)
    holes = SequenceBatch(tokens=torch.tensor([[5, 0, 6, 7]]),
                          attention_mask=torch.tensor([[1, 0, 1, 1]]),
                          response_mask=torch.tensor([[0, 0, 0, 1]]))
    with pytest.raises(ValueError, match="padding between real tokens"):
        microbatches(_engine(), Batching(max_tokens=100), holes)


def test_shared_prompt_layout():
    """Two samples of the prompt [2, 3, 4, 5, 6, 7]: they share [2 .. 6] and each repeats 7
    in a block of its own; RoPE places both blocks right after the prompt. 11 model
    positions instead of 2 x 8. With a sample of another prompt beside them, a row with
    two blocks would leave that prompt's row a block empty: each sample then has a row."""
    batch = SequenceBatch(
        tokens=torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7, 3, 0],
                             [0, 0, 0, 0, 1, 7, 2, 0]]),
        attention_mask=torch.tensor([[1] * 8, [1] * 7 + [0], [0] * 4 + [1] * 3 + [0]]),
        response_mask=torch.tensor([[0] * 6 + [1, 1], [0] * 6 + [1, 0], [0] * 6 + [1, 0]]))
    two = SequenceBatch(tokens=batch.tokens[:2], attention_mask=batch.attention_mask[:2],
                        response_mask=batch.response_mask[:2])
    (mb,) = microbatches(_engine(), Batching(share_prompts=True), two, response_logits=True)
    assert mb["tokens"].tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 7, 3, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 0]]
    assert mb["labels"].tolist() == [[3, 4, 5, 6, 7, 8, 9, 0, 3, 0, 0]]
    assert mb["rotary_columns"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7]
    assert mb["shared_prompt"].tolist() == [[True] * 5 + [False] * 6]
    allowed = ~document_mask(mb["document_ids"], shared=mb["shared_prompt"])[0, 0]
    assert allowed[9].tolist() == [True] * 5 + [False] * 3 + [True, True, False]
    assert mb["token_index"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 8, 9, -1]]
    # The positions whose outputs the response tokens read (their logprobs): 5 for 8, 6 for
    # 9, 8 for 3.
    assert mb["logit_index"].tolist() == [5, 6, 8]
    (mb,) = microbatches(_engine(), Batching(share_prompts=True), batch, response_logits=True)
    assert mb["tokens"].tolist() == batch.tokens.tolist()
    assert mb["shared_prompt"].int().tolist() == [[1] * 5 + [0] * 3, [1] * 5 + [0] * 3,
                                                  [0] * 4 + [1] + [0] * 3]
    assert mb["rotary_columns"].tolist() == list(range(8))
    # A mixture-of-experts model keeps a row per sample.
    (mb,) = microbatches(_engine(experts=8), Batching(share_prompts=True), two)
    assert "shared_prompt" not in mb and mb["tokens"].shape == (2, 8)
    with pytest.raises(ValueError, match="share_prompts or pack, not both"):
        Batching(max_tokens=10, share_prompts=True, pack=True)


def test_a_token_budget_counts_a_shared_prompt_once():
    """The batch above under token budgets: at 11 positions the two samples of one prompt
    share one model row of 11 (a row each would cost 2 x 8 = 16) and the third row, another
    prompt, has a micro-batch of its own; at 10 the two samples cannot share, and go one per
    micro-batch (a row alone must fit). Two such prompts over two DP ranks: a prompt's
    samples stay together, one prompt per rank. Where fewer prompts than ranks make prompts
    be cut, the pieces still fit the budget (three samples of a 10-token row at TP8 + SP,
    whose two-sample piece would lay out as two rows of 16, 32 > 24)."""
    batch = SequenceBatch(
        tokens=torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7, 3, 0],
                             [0, 0, 0, 0, 1, 7, 2, 0]]),
        attention_mask=torch.tensor([[1] * 8, [1] * 7 + [0], [0] * 4 + [1] * 3 + [0]]),
        response_mask=torch.tensor([[0] * 6 + [1, 1], [0] * 6 + [1, 0], [0] * 6 + [1, 0]]))
    mbs = microbatches(_engine(), Batching(max_tokens=11, share_prompts=True), batch)
    assert [(mb["rows"].tolist(), tuple(mb["tokens"].shape)) for mb in mbs] == [
        ([0, 1], (1, 11)), ([2], (1, 3))]
    mbs = microbatches(_engine(), Batching(max_tokens=10, share_prompts=True), batch)
    assert sorted(mb["rows"].tolist() for mb in mbs) == [[0], [1], [2]]
    again = torch.tensor([[5, 3, 4, 5, 6, 7, 8, 9], [5, 3, 4, 5, 6, 7, 3, 0]])
    two = SequenceBatch(tokens=torch.cat([batch.tokens[:2], again]),
                        attention_mask=batch.attention_mask[[0, 1, 0, 1]],
                        response_mask=batch.response_mask[[0, 1, 0, 1]])
    ranks = [[(mb["rows"].tolist(), tuple(mb["tokens"].shape)) for mb in microbatches(
        _engine(2, rank), Batching(max_tokens=11, share_prompts=True), two)]
        for rank in range(2)]
    assert ranks == [[([0, 1], (1, 11))], [([2, 3], (1, 11))]]
    three = SequenceBatch(tokens=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]] * 3),
                          attention_mask=torch.ones(3, 10, dtype=torch.long),
                          response_mask=torch.tensor([[0] * 4 + [1] * 6] * 3))
    for dp in (1, 2):
        for rank in range(dp):
            engine = _engine(dp, rank, tp=8, sequence_parallel=True)
            # Attention weighing more (16 heads, hidden 16): a two-sample piece of the
            # prompt gets a row per sample (_samples_per_row), costlier than all three shared.
            engine.spec.model.hidden_size = engine.spec.model.num_attention_heads = 16
            for mb in microbatches(engine, Batching(max_tokens=24, share_prompts=True), three):
                assert mb["tokens"].numel() <= 24, (dp, rank, mb["tokens"].shape)
