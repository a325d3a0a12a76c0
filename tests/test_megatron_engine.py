"""The Megatron rollout engine: batched, left-padded generation with megatron-core's KV cache
against one-prompt-at-a-time full forwards; sampling, stop tokens, weight updates from an
HF-named stream, sleep/wake, errors; TP2 against TP1 on the same weights.

Tolerance: logprobs within 1e-5 (fp32). The cached, padded batch and the unpadded full forward
differ only in summation order and in the RoPE angles of left-padded rows (a shift the relative
encoding cancels exactly in real arithmetic): measured <= 3e-6. A missing padding mask, a wrong
position or a stale cache entry moves logprobs by >= 1e-2 and flips greedy tokens. Tokens must
be equal: the test weights (std 0.15) make the top two logits of every step differ by far more
than 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig as P
from tests import generation_workers as gw

TOL = 1e-5
VOCAB = 300  # the tiny preset's; TP padding takes it to 304 (TP1) or 320 (TP2)
# Different lengths, so every batch has left padding; ids 1..255 leave room for stop ids.
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9], [100, 200, 3, 4, 250]]
STEPS = gw.GREEDY.max_new_tokens
# Matmuls this small gain nothing from a second thread, and spinning threads thrash when the
# two cores are shared with other jobs (measured: 8x slower).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tp1(tiny):
    return launch_local(gw.tp1_checks, 1, tiny, PROMPTS, env=ONE_THREAD)[0]


def _tokens(completions):
    return [c[1] for c in completions]


def test_greedy_with_kv_cache_equals_full_forward_argmax(tp1):
    assert [c[0] for c in tp1["greedy"]] == [0, 1, 2, 3]
    for (_, tokens, logprobs, reason), (ref_tokens, ref_logprobs) in zip(tp1["greedy"],
                                                                         tp1["greedy_ref"]):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs),
                                   atol=TOL, rtol=0)
        assert reason == "length"


def test_repetition_penalty_matches_the_hf_rule(tp1):
    # Every token is the argmax of the penalised full-forward logits given the ids before it.
    assert _tokens(tp1["penalized"]) == [choices for choices, _ in tp1["penalized_ref"]]
    assert _tokens(tp1["penalized"]) != _tokens(tp1["greedy"])  # the penalty changed choices
    # Logprobs stay those of the raw logits, whatever the penalty did to the choice.
    for (_, _, logprobs, _), (_, ref_logprobs) in zip(tp1["penalized"], tp1["penalized_ref"]):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs),
                                   atol=TOL, rtol=0)


def test_sampling_is_reproducible_with_a_seed_and_differs_with_another(tp1):
    first, again, other = tp1["sampled"]
    assert first == again
    assert _tokens(first) != _tokens(other)
    n = gw.SAMPLED.n
    assert [c[0] for c in first] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    # The n samples of a prompt are drawn independently, not copies of one another.
    assert any(len({tuple(t) for t in _tokens(first)[i * n:(i + 1) * n]}) > 1
               for i in range(len(PROMPTS)))


def test_sampled_logprobs_are_the_raw_model_logprobs(tp1):
    # Temperature, top-k/top-p and the penalty shape the choice, never the reported logprob.
    for (_, _, logprobs, _), ref in zip(tp1["sampled"][0], tp1["sampled_ref_logprobs"]):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref), atol=TOL, rtol=0)


def test_first_token_candidates_get_the_full_forwards_logprobs(tp1):
    # A judge's yes/no: every sample of a prompt reports the candidates' log p at its first
    # new token, whatever it then samples.
    n = gw.SAMPLED.n
    assert [i for i, _ in tp1["first"]] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for i, logprobs in tp1["first"]:
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(tp1["first_ref"][i]),
                                   atol=TOL, rtol=0)
    kind, message = tp1["first_out_of_vocab"]
    assert kind == "ValueError" and "first_token_candidates (300,) reach outside" in message


def test_top_k_1_equals_greedy(tp1):
    assert _tokens(tp1["top_k1"]) == _tokens(tp1["greedy"])


def test_each_id_is_drawn_with_its_probability_and_truncated_ids_never(monkeypatch):
    from megarlhf.rollout.megatron_engine import _draw

    probs = torch.tensor([0.5, 0.0, 0.2, 0.3 - 1e-3, 0.0, 1e-3])
    draws = 400_000
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(_draw(probs.repeat(draws, 1), generator), minlength=6).double()
    # Each count is binomial(draws, p): 5 standard deviations (a false alarm ~1e-6 per id).
    # An off-by-one in the search moves 0.2 or 0.3 of the mass to a neighbour: > 400 sd.
    expected = draws * probs.double()
    sd = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 5 * sd).all(), counts
    assert counts[1] == counts[4] == 0
    # A uniform number that rounds up to the total still draws the last id with a share.
    monkeypatch.setattr(torch, "rand", lambda shape, **_: torch.ones(shape, dtype=torch.float64))
    assert _draw(torch.tensor([[0.25, 0.75, 0.0]]), generator).tolist() == [1]
    # A diverged model's probabilities raise rather than draw an id.
    with pytest.raises(ValueError, match="not finite"):
        _draw(torch.tensor([[0.5, 0.5], [float("nan"), 0.5]]), generator)


def test_stop_tokens_end_a_sample_and_leave_the_others_unchanged(tp1):
    # The stop id is one that prompt 0's greedy run emits: rows that emit it end there, the
    # rest must go on exactly as without stop ids after the finished rows leave the batch.
    stop = tp1["stop_token"]
    for (_, tokens, logprobs, reason), (_, full, full_logprobs, _) in zip(
            tp1["greedy_stopped"], tp1["greedy"]):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert tokens == full[:end]
        assert reason == ("stop" if stop in full else "length")
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(full_logprobs[:end]),
                                   atol=TOL, rtol=0)
    assert {c[3] for c in tp1["greedy_stopped"]} == {"stop", "length"}


def test_each_prompt_takes_its_own_number_of_new_tokens(tp1):
    # Rows leave the batch at their own limits; the others go on as without limits.
    assert [len(c[1]) for c in tp1["greedy_limited"]] == list(tp1["limits"])
    for (_, tokens, logprobs, reason), (_, full, full_logprobs, _) in zip(
            tp1["greedy_limited"], tp1["greedy"]):
        assert tokens == full[:len(tokens)] and reason == "length"
        torch.testing.assert_close(torch.tensor(logprobs),
                                   torch.tensor(full_logprobs[:len(tokens)]), atol=TOL, rtol=0)


def test_sampled_rows_stop_independently(tp1):
    stops = {tp1["stop_token"], 7, 8, 9}
    reasons = set()
    for _, tokens, logprobs, reason in tp1["sampled_stopped"]:
        assert len(tokens) == len(logprobs)
        assert not stops & set(tokens[:-1])
        if reason == "stop":
            assert tokens[-1] in stops
        else:
            assert reason == "length" and len(tokens) == STEPS and tokens[-1] not in stops
        reasons.add(reason)
    assert reasons == {"stop", "length"}


def test_update_weights_from_a_models_stream_reproduces_that_model(tp1):
    assert tp1["stream_logits_diff"] == 0.0  # the same weights through the same modules
    assert tp1["stream_greedy"] == tp1["stream_greedy_ref"]
    assert tp1["stream_greedy"] != _tokens(tp1["greedy"])  # the weights really changed


def test_vocab_padding_is_zero_and_never_chosen(tp1):
    assert tp1["padding_rows"] > 0 and tp1["padding_rows_max"] == 0.0
    for tokens in tp1["chosen_with_hot_padding"]:
        assert max(tokens) < VOCAB


def test_update_weights_names_bad_streams(tp1):
    assert tp1["unknown"][0] == "ValueError"
    assert "unknown weight 'lm_head.bias'" in tp1["unknown"][1]
    assert tp1["misshapen"][0] == "ValueError"
    assert f"weight {tp1['missing_name']!r} has shape" in tp1["misshapen"][1]
    assert tp1["missing"] == ("ValueError", f"megatron engine rank 0: 1 weight(s) never "
                                            f"arrived: {tp1['missing_name']}")
    assert "arrived twice" in tp1["twice"][1]
    # A failed update leaves a half-written model, which generate refuses.
    assert tp1["after_failed_update"][0] == "EngineError"
    assert "call update_weights before generate" in tp1["after_failed_update"][1]
    assert tp1["before_weights"][0] == "EngineError"


def test_sleep_frees_the_weights_and_wake_needs_an_update(tp1):
    assert tp1["asleep_bytes"] == 0
    assert tp1["asleep_generate"][0] == "EngineError"
    assert tp1["asleep_update"] == ("EngineError", "megatron engine rank 0: asleep; call wake() "
                                                   "before update_weights")
    assert tp1["woken_generate"][0] == "EngineError"
    assert tp1["greedy_after_wake"] == tp1["greedy"]
    # sleep(keep_weights=True), a judge's: freed, and back on wake without an update.
    for cycle in (1, 2):
        assert tp1[f"kept_asleep_bytes_{cycle}"] == 0
        assert tp1[f"greedy_after_kept_wake_{cycle}"] == tp1["greedy"]
    # An update drops the kept copy: a later kept sleep brings back the new weights.
    assert tp1["greedy_after_zero_update"] != tp1["greedy"]


def test_a_failure_inside_generation_names_the_engine(tp1):
    assert tp1["failing_generate"] == (
        "EngineError", "megatron engine rank 0: generation failed: RuntimeError: simulated "
                       "kernel failure")


def test_bad_input_is_refused_clearly(tp1):
    assert tp1["too_long"][0] == "ValueError"
    assert "max_position_embeddings=256" in tp1["too_long"][1]
    assert tp1["bad_prompt"] == ("ValueError", "megatron engine rank 0: prompt 1 is empty; "
                                               "every prompt needs at least one token")
    assert tp1["pp2"][0] == "ValueError"
    assert "pipeline_parallel=2" in tp1["pp2"][1]


@pytest.mark.slow
def test_tp2_generates_what_tp1_does(tiny):
    unseeded = dataclasses.replace(gw.SAMPLED, seed=None)
    params = [gw.GREEDY, gw.SAMPLED, unseeded]
    (at_tp1,) = launch_local(gw.generations, 1, tiny, P(), PROMPTS, params, env=ONE_THREAD)
    rank0, rank1 = launch_local(gw.generations, 2, tiny, P(tensor_parallel=2), PROMPTS, params,
                                env=ONE_THREAD)
    assert rank0 == rank1  # TP ranks agree on every token, unseeded sampling included
    for ours, ref in zip(rank0[:2], at_tp1[:2]):
        assert _tokens(ours) == _tokens(ref)
        assert [c[3] for c in ours] == [c[3] for c in ref]
        for (_, _, logprobs, _), (_, _, ref_logprobs, _) in zip(ours, ref):
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs),
                                       atol=TOL, rtol=0)
