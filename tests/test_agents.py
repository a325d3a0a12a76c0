"""Agent programs over the OpenAI-compatible endpoint, without a model: the scripted engine of
tests/test_envs.py answers, the programs (tests/agent_programs.py) use the real `openai`
client over real HTTP. Checked: each episode is one row whose trained tokens are exactly what
the engine returned, its observations what the chat template renders, the contexts the
engine was given, tool calls, stop strings, history rewrites, keys, budgets and failures."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from megarlhf.data.templates import PromptFormat
from megarlhf.envs.agents import AgentLimits, AgentRunner, load_agent
from tests import agent_programs
from tests.test_envs import PARAMS, ScriptedEngine, _full_render, _prompt, tok  # noqa: F401

pytest.importorskip("openai")


def _runner(tok, program: str, *, scored_elsewhere: bool = True, **limits) -> AgentRunner:
    options = dict(max_calls=4, max_new_tokens=200, max_tokens=400, timeout=30.0,
                   max_requests=64)
    options.update(limits)
    return AgentRunner(load_agent(f"tests.agent_programs:{program}"), PromptFormat(tok, "chat"),
                       AgentLimits(**options), name=program, tool_parser="hermes",
                       scored_elsewhere=scored_elsewhere)


def _engine_turns(tok, reply, key: int, count: int) -> list[list[int]]:
    return [tok.encode(reply(key, k)) + [tok.eos_id] for k in range(count)]


def test_a_conversation_that_extends_itself_is_one_row_of_the_engines_exact_tokens(tok):
    """two_calls asks, sends its answer back (the client's message object, dumped) with a
    follow-up and asks again. Per episode: one row, its prompt the row's, its trained tokens
    exactly the two completions the engine returned (with their logprobs), between them
    the follow-up as the template renders it after the model's end-of-turn (masked); the
    second call's context was exactly the first's + its completion + that observation; the
    whole row is the template's own rendering of the conversation. All four episodes' calls
    are one engine call per round, with their keys."""
    reply = lambda key, turn: f"{7 + key} {turn}"  # noqa: E731
    engine = ScriptedEngine(tok, reply)
    params = dataclasses.replace(PARAMS, n=2, seed=5)
    prompts = [_prompt(tok), _prompt(tok, "Hi")]
    episodes, metrics = _runner(tok, "two_calls").run(prompts, params, engine)
    assert [c[2] for c in engine.calls] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert [c[3].seed for c in engine.calls] == [5, 5 + 2**40]
    fmt = PromptFormat(tok, "chat")
    follow_up = fmt.observation([{"role": "user", "content": "Sure?"}], after=tok.eos_id)
    for e in episodes:
        first, second = _engine_turns(tok, reply, e.completion.prompt_index, 2)
        prompt = list(prompts[e.completion.prompt_index // 2].ids)
        c = e.completion
        assert list(e.prompt.ids) == prompt
        assert c.token_ids == first + follow_up + second
        assert list(c.sampled) == [True] * len(first) + [False] * len(follow_up) \
            + [True] * len(second)
        engine_logprobs = [-0.01 * (j + 1) for j in range(len(first))] + \
            [-0.01 * (j + 1) for j in range(len(second))]
        assert [lp for lp, s in zip(c.logprobs, c.sampled) if s] == engine_logprobs
        key = e.completion.prompt_index
        assert engine.calls[0][0][key] == prompt
        assert engine.calls[1][0][key] == prompt + first + follow_up
        assert tok.decode(prompt + c.token_ids) == _full_render(tok, e)[:-1]
        assert list(e.rewards_at) == [(len(c.token_ids) - 1, 1.0)] and e.error is None
    # What each client received: the engine's text and logprobs.
    seen = [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)]
    assert len(seen) == 4
    for responses in seen:
        for answer in responses:
            got = [t.logprob for t in answer.choices[0].logprobs.content]
            assert got == pytest.approx([-0.01 * (j + 1) for j in range(len(got))])
    assert metrics["agent/calls_mean"] == 2.0 and metrics["agent/errors"] == 0.0
    assert metrics["agent/untrained_completions"] == 0.0


def test_tool_calls_round_trip_and_still_splice_exactly(tok):
    """with_tools: the model's hermes call comes back as tool_calls (arguments as JSON), the
    program sends the message back with its arguments re-serialised and a tool message;
    the second call still extends the first exactly, the tool message masked."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 7, "b": 5}}</tool_call>'
    engine = ScriptedEngine(tok, lambda key, turn: [call, "12"][turn])
    (episode,), metrics = _runner(tok, "with_tools").run([_prompt(tok)], PARAMS, engine)
    (first, second), = [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)]
    (tool_call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == \
        ("add", {"a": 7, "b": 5})
    assert second.choices[0].message.content == "12"
    turns = _engine_turns(tok, lambda key, turn: [call, "12"][turn], 0, 2)
    c = episode.completion
    assert [t for t, s in zip(c.token_ids, c.sampled) if s] == sum(turns, [])
    assert [(p.role, p.trained) for p in episode.parts] == [
        ("assistant", True), ("tool", False), ("assistant", True)]
    assert episode.parts[1].text == "\n<|im_start|>user\n<tool_response>12</tool_response>\n" \
                                    "<|im_end|>\n<|im_start|>assistant\n"
    # The engine's first context rendered the tools; the second extends it exactly.
    first_context = engine.calls[0][0][0]
    assert '"name": "add"' in tok.decode(first_context)
    assert engine.calls[1][0][0] == first_context + turns[0] + \
        tok.encode(episode.parts[1].text)
    assert list(episode.prompt.ids) + c.token_ids == engine.calls[1][0][0] + turns[1]
    assert metrics["agent/untrained_completions"] == 0.0


def test_a_verifiers_tool_environment_is_one_exact_row_scored_by_its_rubric(tok):
    """megarlhf.envs.calculator_verifiers:solve (verifiers' ToolEnv with the calculator)
    answered by a scripted model that calls the calculator, then answers the product (episodes
    of even key) or the product + 1 (odd): per episode, two calls, one row whose trained
    tokens are exactly the engine's two completions with the calculator's result between
    them masked, and the environment's rubric's reward (1.0 for the product, 0.0 otherwise,
    as the ground truth says)."""
    from megarlhf.envs.calculator_verifiers import records

    rows, _ = records(rows=2, held_out=0)
    factors = [[int(w.rstrip("?")) for w in r["prompt"][-1]["content"].split()[2:5:2]]
               for r in rows]
    call = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{} * {}"}}}}' \
        '</tool_call>'
    reply = lambda key, turn: call.format(*factors[key // 2]) if turn == 0 else \
        str(factors[key // 2][0] * factors[key // 2][1] + key % 2)  # noqa: E731
    engine = ScriptedEngine(tok, reply)
    fmt = PromptFormat(tok, "chat")
    prompts = [_prompt(tok, tuple((m["role"], m["content"]) for m in r["prompt"]),
                       ground_truth=r["ground_truth"]) for r in rows]
    runner = AgentRunner(load_agent("megarlhf.envs.calculator_verifiers:solve"), fmt,
                         AgentLimits(max_calls=4, max_new_tokens=200, max_tokens=800,
                                     timeout=60.0, max_requests=64),
                         name="calculator_verifiers", tool_parser="hermes",
                         scored_elsewhere=False)
    episodes, metrics = runner.run(prompts, dataclasses.replace(PARAMS, n=2), engine)
    assert metrics["agent/calls_mean"] == 2.0 and metrics["agent/errors"] == 0.0
    assert metrics["agent/untrained_completions"] == 0.0
    for e in episodes:
        key = e.completion.prompt_index
        first, second = _engine_turns(tok, reply, key, 2)
        a, b = factors[key // 2]
        assert e.error is None
        assert [(p.role, p.trained) for p in e.parts] == [
            ("assistant", True), ("tool", False), ("assistant", True)]
        assert f"<tool_response>{a * b}</tool_response>" in e.parts[1].text
        c = e.completion
        assert [t for t, on in zip(c.token_ids, c.sampled) if on] == first + second
        assert engine.calls[1][0][key] == list(e.prompt.ids) + first + tok.encode(e.parts[1].text)
        assert list(e.rewards_at) == [(len(c.token_ids) - 1, 1.0 if key % 2 == 0 else 0.0)]


def test_what_verifiers_would_score_without_computing_fails_the_episode(tok):
    """verifiers scores 0.0 for a reward function that raises or returns no number, a model
    call the endpoint refused, and a rollout past the environment's timeout: each episode is
    masked and counted instead. An empty answer past the episode's call budget is an answer
    (verifiers would fail the rollout on it): the two-turn environment limited to one call is
    scored. Environments verifiers scores without computing are refused where the agent is
    loaded."""
    import verifiers as vf

    from megarlhf.envs.verifiers_agent import verifiers_agent

    for program, reason in (
            ("verifiers_raising", "reward function failed: _broken: KeyError"),
            ("verifiers_no_number", "reward function failed: _no_number: returned None"),
            ("verifiers_refused_call", "the verifiers rollout failed"),
            ("verifiers_timed_out", "the verifiers rollout stopped: timeout_reached")):
        (failed,), metrics = _runner(tok, program, scored_elsewhere=False).run(
            [_prompt(tok)], PARAMS, ScriptedEngine(tok, lambda key, turn: "12"))
        assert reason in failed.error, (program, failed.error)
        assert failed.rewards_at == () and metrics["agent/errors"] == 1.0
    (capped,), metrics = _runner(tok, "verifiers_two_calls", max_calls=1,
                                 scored_elsewhere=False).run(
        [_prompt(tok)], PARAMS, ScriptedEngine(tok, lambda key, turn: "12"))
    assert capped.error is None and metrics["agent/calls_mean"] == 1.0
    assert list(capped.rewards_at) == [(len(capped.completion.token_ids) - 1, 0.0)]
    one = agent_programs.single_turn_environment
    for build, refusal in (
            (lambda: vf.EnvGroup([one(agent_programs._by_length)]), "EnvGroup"),
            (lambda: one(agent_programs._by_length, score_rollouts=False),
             "score_rollouts=False"),
            (lambda: vf.SingleTurnEnv(dataset=one(agent_programs._by_length).dataset,
                                      rubric=vf.Rubric(funcs=[_group_reward])),
             "group reward functions")):
        with pytest.raises(ValueError, match=refusal):
            verifiers_agent(build)


def _group_reward(completions, **_) -> list[float]:
    return [0.0] * len(completions)


def test_a_stop_string_ends_what_is_returned_and_trained(tok):
    """stop=["\\n"]: the engine's "12\\nmore words" is returned as "12", and the row keeps the
    tokens through the newline only."""
    engine = ScriptedEngine(tok, lambda key, turn: "12\nmore words")
    (episode,), _ = _runner(tok, "stops_at_newline").run([_prompt(tok)], PARAMS, engine)
    (answer,), = [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)]
    assert answer.choices[0].message.content == "12"
    assert answer.choices[0].finish_reason == "stop"
    ids = tok.encode("12\nmore words")
    kept = next(k for k in range(1, len(ids) + 1) if "\n" in tok.decode(ids[:k]))
    assert episode.completion.token_ids == ids[:kept] < ids
    assert episode.completion.finish_reason == "stop"
    assert list(episode.rewards_at) == [(kept - 1, 0.5)]


def test_an_agent_that_rewrites_history_trains_its_last_call_and_counts_the_rest(tok):
    """rewrites asks, then asks again with a system message first and without its first
    answer: the row is the second call's context as the template renders it (it does not
    start with the row's prompt, so all of it is the row's prompt) plus its completion; the
    first completion is counted, not trained. It returns None: the run's reward sources
    score it, and without any the episode is masked as failed."""
    reply = lambda key, turn: f"answer {turn}"  # noqa: E731
    engine = ScriptedEngine(tok, reply)
    (episode,), metrics = _runner(tok, "rewrites").run([_prompt(tok)], PARAMS, engine)
    agent_programs.SEEN.clear()
    second_context = engine.calls[1][0][0]
    assert tok.decode(second_context).startswith("<|im_start|>system\nBe brief.")
    assert list(episode.prompt.ids) == second_context
    assert episode.completion.token_ids == _engine_turns(tok, reply, 0, 2)[1]
    assert all(episode.completion.sampled)
    assert metrics["agent/untrained_completions"] == 1.0 and metrics["agent/calls_mean"] == 2
    assert episode.error is None and episode.rewards_at == ()  # None: the run scores it
    (masked,), metrics = _runner(tok, "rewrites", scored_elsewhere=False).run(
        [_prompt(tok)], PARAMS, ScriptedEngine(tok, reply))
    agent_programs.SEEN.clear()
    assert "returned None, and the run has no reward function or reward service" in masked.error
    assert metrics["agent/errors"] == 1.0


def test_keys_budgets_and_failing_programs(tok):
    """A wrong key gets 401 (and the program goes on with its own); a program that raises or
    hangs past agent_timeout is masked and counted, its row what it sampled; max_calls ends
    a program's calls with an empty answer finished by length."""
    engine = ScriptedEngine(tok, lambda key, turn: f"{turn}")
    (ok,), _ = _runner(tok, "wrong_key").run([_prompt(tok)], PARAMS, engine)
    (refused, answer), = [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)]
    assert refused == ("refused", 401) and answer.choices[0].message.content == "0"
    assert ok.error is None
    for program, reason in (("raises", "RuntimeError: the agent's own bug"),
                            ("hangs", "timed out after agent_timeout=1 s")):
        (failed,), metrics = _runner(tok, program, timeout=1.0).run(
            [_prompt(tok)], PARAMS, ScriptedEngine(tok, lambda key, turn: "5"))
        assert reason in failed.error and failed.rewards_at == ()
        assert failed.completion.token_ids == tok.encode("5") + [tok.eos_id]
        assert metrics["agent/errors"] == 1.0
    (capped,), metrics = _runner(tok, "many_calls", max_calls=3).run(
        [_prompt(tok)], PARAMS, ScriptedEngine(tok, lambda key, turn: f"{turn}"))
    (answers,) = [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)]
    assert [a.choices[0].message.content for a in answers] == ["0", "1", "2", ""]
    assert answers[-1].choices[0].finish_reason == "length"
    assert sum(capped.completion.sampled) == 3 * 2  # three turns of a digit and end-of-turn
    assert metrics["agent/calls_mean"] == 3.0


def test_requests_the_endpoint_cannot_serve_are_answered_400(tok):
    """An empty stop string, max_tokens 0, n > 1, no messages, tools that are not function
    schemas: each answered 400 (the client does not retry those), and the episode goes on."""
    (episode,), metrics = _runner(tok, "bad_requests").run(
        [_prompt(tok)], PARAMS, ScriptedEngine(tok, lambda key, turn: "5"))
    (seen,) = [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)]
    assert seen[:-1] == [400] * 5 and seen[-1].choices[0].message.content == "5"
    assert episode.error is None and metrics["agent/calls_mean"] == 1.0


class SlowSecondCall(ScriptedEngine):
    """The scripted engine, 0.6 s per call after the first."""

    def __call__(self, contexts, params, keys):
        if self.calls:
            time.sleep(0.6)
        return super().__call__(contexts, params, keys)


def test_an_answer_its_program_never_received_is_not_trained(tok):
    """abandons gives up on its second call after 0.2 s and returns 1.0; the engine answers
    that call later. The row is the first call's: the completion nobody received is neither
    trained nor counted as the program's."""
    engine = SlowSecondCall(tok, lambda key, turn: f"{turn}")
    (episode,), metrics = _runner(tok, "abandons").run([_prompt(tok)], PARAMS, engine)
    assert [agent_programs.SEEN.pop(k) for k in list(agent_programs.SEEN)] == [["gave up"]]
    assert len(engine.calls) == 2  # the abandoned call did reach the engine
    assert episode.completion.token_ids == tok.encode("0") + [tok.eos_id]
    assert list(episode.rewards_at) == [(1, 1.0)] and episode.error is None
    assert metrics["agent/calls_mean"] == 1.0


def test_an_engine_failure_stops_the_run_and_is_no_programs_error(tok):
    """The engines fail on the second round: run() raises their error (the programs are
    cancelled, none is counted as failed), rather than masking every episode."""

    def broken(contexts, params, keys):
        if broken.calls:
            raise ConnectionError("rollout rank 0 is gone")
        broken.calls += 1
        return ScriptedEngine(tok, lambda key, turn: "1")(contexts, params, keys)

    broken.calls = 0
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="rollout rank 0 is gone"):
        _runner(tok, "two_calls").run([_prompt(tok)] * 2, PARAMS, broken)
    assert time.monotonic() - start < 10
    agent_programs.SEEN.clear()


def test_a_program_timed_out_while_its_call_is_in_the_engines(tok):
    """agent_timeout (0.4 s) ends two_calls while its second call is in the engines (0.6 s):
    the episode is masked and counted, the step's rows come back (no stray cancellation),
    and the late answer is not its row's."""
    engine = SlowSecondCall(tok, lambda key, turn: f"{turn}")
    (episode,), metrics = _runner(tok, "two_calls", timeout=0.4).run([_prompt(tok)], PARAMS,
                                                                     engine)
    agent_programs.SEEN.clear()
    assert "timed out after agent_timeout=0.4 s" in episode.error
    assert episode.completion.token_ids == tok.encode("0") + [tok.eos_id]
    assert metrics["agent/errors"] == 1.0 and len(engine.calls) == 2
