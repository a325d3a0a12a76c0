"""reward_url (megarlhf/ppo/remote_reward.py) against a real HTTP server on this machine
(tests/reward_server.py): both formats, batching, headers, retries, the failed-share bound,
and the mistakes that stop a run at once."""

from __future__ import annotations

import socket

import pytest

from megarlhf.ppo import remote_reward
from megarlhf.ppo.remote_reward import RemoteReward, check_reachable, read_headers, url_problem
from megarlhf.ppo.rewards import RewardFnError
from megarlhf.rewards.calls import Sample
from tests.ppo_tasks import low_token_fraction
from tests.reward_server import RewardServer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(remote_reward, "FIRST_WAIT_S", 0.01)  # retry waits: not what is tested
    s = RewardServer()
    yield s
    s.close()


def _samples(n: int) -> list[Sample]:
    return [Sample(prompt=f"p{i}", response="x" * (i + 1), prompt_ids=[1, 2],
                   response_ids=[5 * i % 300, 40 + i, 7], ground_truth=str(i),
                   data_source="d", metadata={"level": i}) for i in range(n)]


def _client(server, **fields) -> RemoteReward:
    settings = dict(fmt="native", batch_size=3, concurrency=2, timeout=5.0, retries=2,
                    headers={}, allow_non_finite=False)
    return RemoteReward(server.url, **{**settings, **fields})


def test_native_batches_carry_every_field_and_headers_and_return_scores(server):
    """7 samples in batches of 3: three requests, each with every field and column of its
    samples and the headers; the scores are the server's, in sample order; a per-sample
    metric it returns is averaged over the samples."""
    samples = _samples(7)
    client = _client(server, headers={"Authorization": "Bearer t0ken"})
    scores, metrics, _ = client.score(1, samples)
    client.close()
    assert scores.tolist() == pytest.approx(
        [low_token_fraction(s.prompt_ids, s.response_ids) for s in samples])
    assert metrics["reward/length"] == 3.0 and metrics["reward/url_failed_samples"] == 0
    bodies = sorted((b for b, _ in server.requests), key=lambda b: b["level"][0])
    assert [len(b["prompts"]) for b in bodies] == [3, 3, 1]
    assert bodies[2] == {"prompts": ["p6"], "responses": ["x" * 7], "ground_truths": ["6"],
                         "data_sources": ["d"], "prompt_ids": [[1, 2]],
                         "response_ids": [[30, 46, 7]], "level": [6]}
    assert all(h["Authorization"] == "Bearer t0ken" for _, h in server.requests)


def test_reply_keys_that_are_not_numbers_per_sample_are_ignored(server):
    server.reply = {"scores": [1, 0, 1], "reasons": ["right", "wrong", "right"], "n": 3,
                    "valid": [True, None, False]}
    client = _client(server)
    scores, metrics, _ = client.score(1, _samples(3))
    client.close()
    assert scores.tolist() == [1.0, 0.0, 1.0] and metrics["reward/valid"] == 0.5
    assert "reward/reasons" not in metrics and "reward/n" not in metrics


def test_openrlhf_format_sends_query_prompts_labels_and_reads_rewards(server):
    samples = _samples(4)
    client = _client(server, fmt="openrlhf", batch_size=8)
    scores, _, _ = client.score(1, samples)
    client.close()
    assert scores.tolist() == [float(len(s.prompt + s.response)) for s in samples]
    (body, _), = server.requests
    assert body == {"query": [s.prompt + s.response for s in samples],
                    "prompts": [s.prompt for s in samples], "labels": ["0", "1", "2", "3"]}


def test_transient_failures_are_retried_then_fail_their_samples(server):
    """503s and timeouts are retried; a batch failing every retry gives its samples no score,
    each with the URL and the last error as its reason, and is counted."""
    samples = _samples(6)
    server.fail_next = [503, 502]
    client = _client(server, batch_size=6, retries=2)
    scores, metrics, failed = client.score(1, samples)
    assert metrics["reward/url_retries"] == 2 and scores.sum() > 0 and failed == [None] * 6
    server.fail_next = [503] * 3  # the first batch's three tries; the second succeeds
    client = _client(server, batch_size=3, concurrency=1, retries=2)
    scores, metrics, failed = client.score(2, samples)
    assert metrics["reward/url_failed_samples"] == 3 and failed[3:] == [None] * 3
    assert failed[:3] == [f"reward_url {server.url} failed after 2 retries: HTTP 503 "
                          f"told to fail"] * 3
    server.delay = 1.0
    slow = _client(server, batch_size=6, timeout=0.2, retries=0)
    _, _, failed = slow.score(4, samples)
    assert all("timed out" in f for f in failed), failed
    for c in (client, slow):
        c.close()


def test_more_failed_samples_than_the_bound_stop_the_run_naming_the_url(server):
    """4 of 6 samples in batches that fail every retry: above max_failed_reward_fraction
    (0.5) the step stops in one line naming the URL and the last error; at the bound it goes
    on."""
    import types

    from megarlhf.ppo.rollouts import check_failures

    server.fail_when = lambda body: body["prompts"][0] != "p4"  # batches 0-1 and 2-3
    client = _client(server, batch_size=2, retries=0)
    _, _, failed = client.score(3, _samples(6))
    client.close()
    assert [f is None for f in failed] == [False] * 4 + [True] * 2
    check_failures(types.SimpleNamespace(max_failed_reward_fraction=0.7), failed, "step 3")
    with pytest.raises(RewardFnError) as stopped:
        check_failures(types.SimpleNamespace(max_failed_reward_fraction=0.5), failed, "step 3")
    assert str(stopped.value) == (
        f"step 3: 4 of 6 samples have no score (more than max_failed_reward_fraction=0.5); "
        f"last failure: reward_url {server.url} failed after 0 retries: HTTP 503 told to fail")


@pytest.mark.parametrize("status,reply,names", [
    (400, None, "answered HTTP 400"),
    (307, None, "answered HTTP 307, a redirect to http://127.0.0.1:1/elsewhere"),
    (200, {"score": [1]}, "the reply has no 'scores' (['score'])"),
    (200, {"scores": [1, 2]}, "'scores' holds 2 values for 3 samples"),
    (200, {"scores": ["high", 1, 1]}, "returned 'high' (str)"),
])
def test_a_reply_no_retry_mends_stops_the_run_at_once(server, status, reply, names):
    server.fail_next, server.reply = ([status] if status != 200 else []), reply
    client = _client(server)
    with pytest.raises(RewardFnError, match=f"reward_url {server.url}.*{names}".replace(
            "[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        client.score(1, _samples(3))
    client.close()
    assert len(server.requests) == 1  # not retried


def test_settings_are_checked_before_any_rank(monkeypatch):
    assert url_problem("ftp://host/x") and url_problem("http:///x")
    assert url_problem("https://rm.example:8443/score") is None
    monkeypatch.setenv("RM_HEADERS", '{"Authorization": "Bearer secret"}')
    assert read_headers("RM_HEADERS") == {"Authorization": "Bearer secret"}
    monkeypatch.setenv("RM_HEADERS", "Bearer secret")
    with pytest.raises(ValueError, match="must hold a JSON object") as caught:
        read_headers("RM_HEADERS")
    assert "secret" not in str(caught.value)
    with pytest.raises(ValueError, match="RM_MISSING is not set"):
        read_headers("RM_MISSING")
    monkeypatch.setenv("RM_HEADERS", '{"Authorization": "Bearer secret\\n"}')  # a line break
    with pytest.raises(ValueError, match="'Authorization' is not a valid HTTP header") as caught:
        read_headers("RM_HEADERS")
    assert "secret" not in str(caught.value)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot connect to 127.0.0.1:{port}"):
        check_reachable(f"http://127.0.0.1:{port}/score")
