"""Multi-turn episodes without a model: a scripted engine answers, real environments and the
ChatML test tokenizer (tests/chat_tokenizer.py) make the observations. Checked: which tokens
are trained on (against the chat template's own rendering of the whole conversation), the
budgets, the contexts the engine is given, rewards at their turns, failures, concurrency,
tool calls, the python sandbox's limits, and the advantages of episodes with masked
observations against plain reference loops."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time

import pytest
import torch

from megarlhf.data.prompts import Prompt
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.envs.episodes import EpisodeError, EpisodeLimits, EpisodeRunner
from megarlhf.envs.loading import environment_factory
from megarlhf.envs.python_tool import PythonSandbox
from megarlhf.envs.tools import (MalformedCall, Toolbox, ToolCall, ToolEnvironment, load_parser,
                                 parse_hermes, parse_llama3_json, tool_schema)
from megarlhf.rollout.engine import Completion, SamplingParams
from megarlhf.rollout.experience import rollout_batch
from tests import chat_tokenizer

QUESTION = "What is 7 + 5? Answer with only the number."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(chat_tokenizer.save(str(tmp_path_factory.mktemp("chatml"))))


class ScriptedEngine:
    """generate() as Placement.rollout: episode `key`'s turn k is `reply(key, k)` (text; an
    end-of-turn token follows it), cut to the turn's limit; logprob of token j is
    -0.01 * (j + 1). Records every call's contexts and limits."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.calls = tok, reply, []
        self.turn_of: dict[int, int] = {}

    def __call__(self, contexts, params, keys):
        limits = params.limits(len(contexts))
        self.calls.append((contexts, limits, keys, params))
        out = []
        for context, limit, key in zip(contexts, limits, keys):
            turn = self.turn_of.get(key, 0)
            self.turn_of[key] = turn + 1
            ids = self.tok.encode(self.reply(key, turn)) + [self.tok.eos_id]
            cut = ids[:limit]
            out.append(Completion(prompt_index=len(out), token_ids=cut,
                                  logprobs=[-0.01 * (j + 1) for j in range(len(cut))],
                                  finish_reason="stop" if len(cut) == len(ids) else "length"))
        return out


def _runner(tok, env, **limits):
    fmt = PromptFormat(tok, "chat")
    options = dict(max_turns=4, max_turn_tokens=40, max_new_tokens=200,
                   max_observation_tokens=100, on_env_error="stop")
    options.update(limits)
    return EpisodeRunner(env if callable(env) else (lambda: env), fmt,
                         EpisodeLimits(**options), name="test_env")


def _prompt(tok, text=QUESTION, **fields) -> Prompt:
    return Prompt(ids=tuple(PromptFormat(tok, "chat").prompt(text)), where="p.jsonl:1",
                  text=text, **fields)


PARAMS = SamplingParams(max_new_tokens=200, n=1, seed=3)


def _full_render(tok, episode) -> str:
    """The chat template's own rendering of the episode's conversation (HF transformers)."""
    return tok.tok.apply_chat_template(list(episode.conversation), tokenize=False)


def test_consecutive_tool_messages_are_masked_and_the_row_is_the_templates_rendering(tok):
    from tests.env_fns import Scripted

    replies = [[{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}],
               [{"role": "user", "content": "Now double it."}]]
    env = Scripted(replies=replies, turns=3)
    engine = ScriptedEngine(tok, lambda key, turn: ["<tool_call>a</tool_call>", "12", "24"][turn])
    (episode,), metrics = _runner(tok, env).run([_prompt(tok)], PARAMS, engine)
    c = episode.completion
    turns = [tok.encode(t) + [tok.eos_id] for t in ("<tool_call>a</tool_call>", "12", "24")]
    # The model's tokens, exactly as sampled (and nothing else), are the trained ones.
    assert [t for t, s in zip(c.token_ids, c.sampled) if s] == sum(turns, [])
    assert [lp for lp, s in zip(c.logprobs, c.sampled) if not s] == [0.0] * (
        len(c.token_ids) - sum(map(len, turns)))
    # The whole row is byte for byte the chat template's rendering of the conversation (the
    # model's last end-of-turn is its last token; the template adds a newline after it).
    assert tok.decode(list(episode.prompt.ids) + c.token_ids) == _full_render(tok, episode)[:-1]
    # The transcript (samples.jsonl) pieces it together exactly.
    assert tok.decode(episode.prompt.ids) + "".join(p.text for p in episode.parts) == \
        _full_render(tok, episode)[:-1]
    observations = [p.text for p in episode.parts if not p.trained]
    assert observations == [
        "\n<|im_start|>user\n<tool_response>5</tool_response>\n<tool_response>7</tool_response>\n"
        "<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nNow double it.<|im_end|>\n<|im_start|>assistant\n"]
    assert [p.role for p in episode.parts] == ["assistant", "tool,tool", "assistant", "user",
                                               "assistant"]
    assert env.seen == ["<tool_call>a</tool_call>", "12", "24"]
    # Each turn's reward at its last model token.
    ends = [i for i in range(len(c.token_ids))
            if c.sampled[i] and (i + 1 == len(c.token_ids) or not c.sampled[i + 1])]
    assert list(episode.rewards_at) == list(zip(ends, [1.0, 2.0, 3.0]))
    assert episode.reward == 6.0 and metrics["env/turns_mean"] == 3.0
    assert metrics["env/turn"] == 2.0 and metrics["env/truncated_fraction"] == 0.0

    # The batch the trainer gets: the response mask is the sampled mask, engine logprobs on
    # model tokens only, rewards where the turns ended; every context the engine was given
    # is a prefix of the row.
    rollout = rollout_batch([list(episode.prompt.ids)], [c],
                            rewards_at=[list(episode.rewards_at)])
    row = rollout.sequences.tokens[0][rollout.sequences.attention_mask[0].bool()].tolist()
    assert row == list(episode.prompt.ids) + c.token_ids
    P = len(episode.prompt.ids)
    assert rollout.sequences.response_mask[0, P:].tolist() == [int(s) for s in c.sampled]
    assert rollout.rewards_at[0, P:].nonzero().flatten().tolist() == ends
    for contexts, _, _, _ in engine.calls:
        assert row[:len(contexts[0])] == contexts[0]
    assert [len(ctx[0]) for ctx, *_ in engine.calls] == \
        [P, P + len(turns[0]) + len(tok.encode(observations[0])),
         P + len(turns[0]) + len(turns[1]) + sum(len(tok.encode(o)) for o in observations)]


def test_a_turn_cut_at_its_length_gets_its_end_of_turn_on_the_observation_side(tok):
    from tests.env_fns import Scripted

    env = Scripted(replies=[[{"role": "user", "content": "Shorter."}]], turns=2)
    engine = ScriptedEngine(tok, lambda key, turn: ["a long answer here", "ok"][turn])
    (episode,), _ = _runner(tok, env, max_turn_tokens=4).run([_prompt(tok)], PARAMS, engine)
    c = episode.completion
    first = tok.encode("a long answer here")[:4]
    assert c.token_ids[:4] == first and c.sampled[:5] == (True,) * 4 + (False,)
    # The end-of-turn the model never emitted comes first in the (masked) observation.
    assert c.token_ids[4] == tok.eos_id
    assert tok.decode(list(episode.prompt.ids) + c.token_ids).startswith(
        tok.decode(list(episode.prompt.ids) + first) + "<|im_end|>\n<|im_start|>user\nShorter.")


def test_an_observation_longer_than_its_limit_is_cut_and_counted(tok):
    from tests.env_fns import Scripted

    long = " ".join(f"word{i}" for i in range(60))
    env = Scripted(replies=[[{"role": "user", "content": long}]], turns=2)
    engine = ScriptedEngine(tok, lambda key, turn: "12")
    (episode,), metrics = _runner(tok, env, max_observation_tokens=30).run(
        [_prompt(tok)], PARAMS, engine)
    (observation,) = [p for p in episode.parts if not p.trained]
    assert observation.tokens <= 30 and metrics["env/observations_cut"] == 1.0
    shown = observation.text.removeprefix("\n<|im_start|>user\n").removesuffix(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert long.startswith(shown) and len(shown) < len(long) // 2
    assert not any(episode.completion.sampled[len(tok.encode("12")) + 1:][:observation.tokens])
    with pytest.raises(EpisodeError, match="max_observation_tokens=5 cannot hold"):
        env = Scripted(replies=[[{"role": "user", "content": long}]], turns=2)
        _runner(tok, env, max_observation_tokens=5).run([_prompt(tok)], PARAMS,
                                                        ScriptedEngine(tok, lambda k, t: "1"))


def test_an_episode_ends_at_max_new_tokens_on_a_model_turn(tok):
    from tests.env_fns import Scripted

    obs = PromptFormat(tok, "chat").observation([{"role": "user", "content": "Go on."}],
                                               after=tok.eos_id)
    answer = tok.encode("12") + [tok.eos_id]
    # Room for turn 1, the observation and 2 tokens of turn 2: turn 2 is cut by the budget.
    budget = len(answer) + len(obs) + 2
    engine = ScriptedEngine(tok, lambda key, turn: "12")
    (episode,), metrics = _runner(tok, Scripted(turns=4), max_new_tokens=budget).run(
        [_prompt(tok)], PARAMS, engine)
    c = episode.completion
    assert len(c.token_ids) == budget and c.sampled[-2:] == (True, True)
    assert c.finish_reason == "length" and metrics["env/truncated_fraction"] == 1.0
    assert engine.calls[1][1] == [2]  # the second turn's limit: what was left
    # One token less: the observation would leave no room, so the episode ends after turn 1.
    engine = ScriptedEngine(tok, lambda key, turn: "12")
    (episode,), metrics = _runner(tok, Scripted(turns=4), max_new_tokens=len(answer) + len(obs)
                                  ).run([_prompt(tok)], PARAMS, engine)
    assert episode.completion.token_ids == answer and all(episode.completion.sampled)
    assert metrics["env/truncated_fraction"] == 1.0 and len(engine.calls) == 1


def test_turns_of_live_episodes_are_one_call_each_and_keep_their_keys(tok):
    from tests.env_fns import Scripted

    # Episode 1 of each prompt stops after one turn (its reply is done at turn 1).
    def make():
        return Scripted(turns=3)

    engine = ScriptedEngine(tok, lambda key, turn: str(key))
    params = dataclasses.replace(PARAMS, n=2, seed=11)
    episodes, metrics = _runner(tok, make).run([_prompt(tok), _prompt(tok, "Hi")], params,
                                               engine)
    assert len(engine.calls) == 3 and [c[2] for c in engine.calls] == [[0, 1, 2, 3]] * 3
    assert [c[3].seed for c in engine.calls] == [11, 11 + 2**40, 11 + 2**41]
    assert all(c[3].n == 1 for c in engine.calls)
    assert [e.final_response for e in episodes] == ["0", "1", "2", "3"]
    assert [e.prompt.text for e in episodes] == [QUESTION, QUESTION, "Hi", "Hi"]
    assert metrics["env/turns_max"] == 3.0


def test_an_episode_carries_the_expert_routing_of_its_last_turn(tok):
    """The last turn's prefill routed every token before it (the Megatron engine records a
    call's prompt and response): that is the episode's routing, of the row's length."""
    import torch

    from tests.env_fns import Scripted

    class Routing(ScriptedEngine):
        def __call__(self, contexts, params, keys):
            out = super().__call__(contexts, params, keys)
            return [dataclasses.replace(c, routing=torch.full(
                (len(ctx) + len(c.token_ids) - 1, 2, 1), len(self.calls), dtype=torch.int16))
                for ctx, c in zip(contexts, out)]

    engine = Routing(tok, lambda key, turn: "12")
    (episode,), _ = _runner(tok, Scripted(turns=3)).run([_prompt(tok)], PARAMS, engine)
    c = episode.completion
    assert c.routing.shape[0] == len(episode.prompt.ids) + len(c.token_ids) - 1
    assert set(c.routing.flatten().tolist()) == {3}  # the third (last) call's
    batch = rollout_batch([list(episode.prompt.ids)], [c])  # fits the row
    assert batch.routing.shape[:2] == batch.sequences.shape


def test_reset_messages_extend_the_prompt_and_the_row_reaches_reset(tok):
    from tests.env_fns import Scripted

    env = Scripted(turns=1, reset_messages=[{"role": "user", "content": "Think first."}])
    engine = ScriptedEngine(tok, lambda key, turn: "12")
    prompt = _prompt(tok, ground_truth="12", data_source="add", metadata={"level": 3})
    (episode,), _ = _runner(tok, env).run([prompt], PARAMS, engine)
    assert env.row == {"prompt": QUESTION, "ground_truth": "12", "data_source": "add",
                       "level": 3}
    assert tok.decode(episode.prompt.ids) == tok.tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}, {"role": "user", "content": "Think first."}],
        tokenize=False, add_generation_prompt=True)
    assert engine.calls[0][0][0] == list(episode.prompt.ids)
    # Reset messages that make the prompt longer than the engines hold next to the budget.
    with pytest.raises(EpisodeError, match=r"make the prompt at p.jsonl:1 \d+ tokens; next to "
                                           r"max_new_tokens the models and engines hold "
                                           r"prompts of 20: raise rollout_max_model_len"):
        _runner(tok, Scripted(turns=1, reset_messages=[{"role": "user", "content": "x"}]),
                max_prompt_tokens=20).run([prompt], PARAMS, ScriptedEngine(tok, lambda k, t: "1"))
    pretokenized = Prompt(ids=prompt.ids, where="c.jsonl:4")
    with pytest.raises(EpisodeError, match="c.jsonl:4 is pre-tokenized"):
        _runner(tok, Scripted(turns=1, reset_messages=[{"role": "user", "content": "x"}])).run(
            [pretokenized], PARAMS, ScriptedEngine(tok, lambda k, t: "1"))


def test_environment_failures_stop_the_run_or_end_the_episode_unscored(tok):
    from tests.env_fns import Failing, NotATurn

    engine = lambda: ScriptedEngine(tok, lambda key, turn: "12")  # noqa: E731
    with pytest.raises(EpisodeError, match=r"environment test_env failed in step\(\) at "
                                           r"p.jsonl:1, turn 2: RuntimeError: the simulator "
                                           r"crashed \(on_env_error=drop masks"):
        _runner(tok, lambda: Failing(at=2)).run([_prompt(tok)], PARAMS, engine())
    with pytest.raises(EpisodeError, match=r"in reset\(\) at p.jsonl:1, turn 0: KeyError: "
                                           r"the task id 'x' is unknown"):
        _runner(tok, lambda: Failing(at=0)).run([_prompt(tok)], PARAMS, engine())
    with pytest.raises(EpisodeError, match=r"turn 1: step\(\) returned dict, not a "
                                           r"megarlhf.envs.Turn"):
        _runner(tok, NotATurn).run([_prompt(tok)], PARAMS, engine())
    params = dataclasses.replace(PARAMS, n=2)
    episodes, metrics = _runner(tok, lambda: Failing(at=2), on_env_error="drop").run(
        [_prompt(tok)], params, engine())
    assert metrics["env/errors"] == 2.0  # no turn reward kept: the episode has no score
    assert all(len(e.rewards_at) == 0 and "the simulator crashed" in e.error for e in episodes)
    assert [sum(not p.trained for p in e.parts) for e in episodes] == [1, 1]  # then ended
    (failed,), metrics = _runner(tok, lambda: Failing(at=0), on_env_error="drop").run(
        [_prompt(tok)], PARAMS, engine())
    assert failed.final_response == "12" and "KeyError" in failed.error  # one turn, from the row


@pytest.mark.parametrize("kind", ["AsyncSleeper", "SyncSleeper"])
def test_the_steps_of_a_turn_run_together(tok, kind):
    """An async step on the event loop, a plain one in the env_workers threads (4 here):
    8 episodes x 2 turns x 0.3 s each are 4.8 s one after another, 0.6 s all together, 1.2 s
    four at a time."""
    from tests import env_fns

    engine = ScriptedEngine(tok, lambda key, turn: "12")
    params = dataclasses.replace(PARAMS, n=8)
    start = time.perf_counter()
    episodes, metrics = _runner(tok, lambda: getattr(env_fns, kind)(0.3, turns=2),
                                workers=4).run([_prompt(tok)], params, engine)
    elapsed = time.perf_counter() - start
    least = 0.6 if kind == "AsyncSleeper" else 1.2
    assert least <= metrics["env/seconds"] and elapsed < least + 1.4, elapsed
    assert [e.reward for e in episodes] == [1.0] * 8


def test_environments_are_loaded_and_checked_by_name():
    from megarlhf.envs.arithmetic import RetryArithmetic

    make = environment_factory("arithmetic_retry", {"max_tries": 2}, toolbox=None)
    assert isinstance(make(), RetryArithmetic) and make().max_tries == 2
    for spec, args, match in [
        ("tests.env_fns:Missing", {}, r"environment 'tests.env_fns:Missing' cannot be loaded: "
                                      r"AttributeError"),
        ("nowhere.at_all:Env", {}, "cannot be loaded: ModuleNotFoundError"),
        ("Scripted", {}, "must be a built-in"),
        ("tests.env_fns:add", {}, "is not a class"),
        ("tests.env_fns:NoStep", {}, r"has no step\(\) method"),
        ("tests.env_fns:WrongStep", {}, r"step\(self\) cannot be called as step\(self, "
                                        r"response\)"),
        ("tests.env_fns:Scripted", {"turn": 3}, r"env_args \['turn'\] do not fit environment"),
    ]:
        with pytest.raises(ValueError, match=match):
            environment_factory(spec, args)


def test_the_arithmetic_environment_pays_less_for_later_tries():
    from megarlhf.envs.arithmetic import RetryArithmetic

    env = RetryArithmetic(max_tries=3)
    env.reset({"ground_truth": "12"})
    first = env.step("11")
    assert (first.reward, first.done, first.metrics) == (
        0.0, False, {"correct": 0.0, "first_try_correct": 0.0})
    assert first.messages[0]["role"] == "user"
    second = env.step("The answer is 12.")
    assert (second.reward, second.done, second.metrics) == (0.5, True, {"correct": 1.0})
    env.reset({"ground_truth": "3"})
    assert [env.step("4").done for _ in range(3)] == [False, False, True]


# -- tools -----------------------------------------------------------------------------------

def test_tool_call_parsers():
    found = parse_hermes('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
                         '</tool_call>\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, '
                         '\\"b\\": 1}"}</tool_call><tool_call>{"name": add}</tool_call>'
                         '<tool_call>{"name": "add"')
    assert found[:2] == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]
    assert isinstance(found[2], MalformedCall) and "not valid JSON" in str(found[2])
    assert isinstance(found[3], MalformedCall)  # cut off before its end
    assert parse_hermes("No calls, just 5.") == []
    assert parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                             '{"name": "add", "parameters": {"a": 3, "b": 4}}') == [
        ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert parse_llama3_json("The answer is 3.") == []
    assert isinstance(parse_llama3_json('{"name": "add", "parameters": [1]}')[0], MalformedCall)
    custom = load_parser("tests.env_fns:bracket_parser")
    assert custom("[[add 1 2]] and [[add 3 -4]]") == [ToolCall("add", {"a": 1, "b": 2}),
                                                      ToolCall("add", {"a": 3, "b": -4})]
    with pytest.raises(ValueError, match=r"tool_parser 'nope' must be a built-in \(hermes, "
                                         r"llama3_json\) or 'module:function'"):
        load_parser("nope")


def test_tool_schemas_come_from_signatures_and_docstrings():
    schema = tool_schema("tests.env_fns:add")
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer", "description": "The first number."}
    with pytest.raises(ValueError, match=r"tools: no JSON schema for tests.env_fns:untyped: "
                                         r"Argument x is missing a type hint"):
        tool_schema("tests.env_fns:untyped")
    with pytest.raises(ValueError, match="tools: 'math' must be 'module:function'"):
        tool_schema("math")
    assert tool_schema("python")["function"]["parameters"]["required"] == ["code"]


def test_the_tools_environment_runs_calls_and_answers_errors(tok):
    box = Toolbox(("tests.env_fns:add", "tests.env_fns:sleep_for", "tests.env_fns:explode",
                   "tests.env_fns:window"), timeout=2.0, workers=2)
    try:
        env = ToolEnvironment(box)
        turn = asyncio.run(env.step(
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
            '<tool_call>{"name": "sub", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "explode", "arguments": {"reason": "x"}}</tool_call>'
            '<tool_call>{"name": "sleep_for", "arguments": {"seconds": 5}}</tool_call>'
            '<tool_call>not json</tool_call>'))
        contents = [m["content"] for m in turn.messages]
        assert contents[0] == "5" and turn.messages[0] == {"role": "tool", "name": "add",
                                                           "content": "5"}
        assert "missing 1 required positional argument: 'b'" in contents[1]
        assert "there is no tool named 'sub'" in contents[2]
        assert "ArithmeticError: cannot: x" in contents[3]
        assert contents[4] == "Error: sleep_for did not finish within 2 s"
        assert "not valid JSON" in contents[5]
        assert turn.metrics == {"tool_calls": 6.0, "tool_errors": 5.0} and not turn.done
        assert asyncio.run(env.step("It is 5.")).done
        # Episodes of a turn call together: their calls (on 2 workers) overlap in time.
        async def four():
            envs = [ToolEnvironment(box) for _ in range(4)]
            call = '<tool_call>{"name": "window", "arguments": {"seconds": 0.5}}</tool_call>'
            return await asyncio.gather(*(e.step(call) for e in envs))

        windows = sorted(tuple(map(float, t.messages[0]["content"].split()))
                         for t in asyncio.run(four()))
        assert any(later[0] < earlier[1] for earlier, later in zip(windows, windows[1:]))
    finally:
        box.close()


@pytest.mark.parametrize("parser,call", [
    ("llama3_json", '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ("hermes", 'Adding. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')])
def test_episodes_of_the_tools_environment_with_each_parser(tok, parser, call):
    """The model calls add, the tool worker answers, the model answers with the result: the
    tool message between the turns is masked and holds the result."""
    box = Toolbox(("tests.env_fns:add",), parser=parser, timeout=30.0, workers=1)
    try:
        make = environment_factory("tools", {}, toolbox=box)
        engine = ScriptedEngine(tok, lambda key, turn: [call, "It is 5."][turn])
        (episode,), metrics = _runner(tok, make, max_turn_tokens=100).run(
            [_prompt(tok)], PARAMS, engine)
    finally:
        box.close()
    assert [(p.role, p.trained) for p in episode.parts] == [
        ("assistant", True), ("tool", False), ("assistant", True)]
    assert episode.parts[1].text == "\n<|im_start|>user\n<tool_response>5</tool_response>\n" \
                                    "<|im_end|>\n<|im_start|>assistant\n"
    assert metrics["env/tool_calls_mean"] == 1.0 and metrics["env/tool_errors"] == 0.0
    assert metrics["env/truncated_fraction"] == 0.0  # a turn without a call ended it


def test_tools_in_the_prompt_template_or_a_system_message(tok, tmp_path):
    schemas = [tool_schema("tests.env_fns:add")]
    with_template = PromptFormat(tok, "chat", tools=schemas, tool_instructions="USE TOOLS")
    assert '"name": "add"' in tok.decode(with_template.prompt("Hi"))
    assert "USE TOOLS" not in tok.decode(with_template.prompt("Hi"))
    # A template without tool support gets them as a system message.
    plain_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}" \
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>" \
                     "assistant\n{% endif %}"
    fmt = PromptFormat(tok, "chat", tools=schemas, tool_instructions="USE TOOLS",
                       chat_template=plain_template)
    assert tok.decode(fmt.prompt([("system", "Be brief."), ("user", "Hi")])) == \
        "<|im_start|>system\nBe brief.\n\nUSE TOOLS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_way_out(tmp_path):
    tok = load_tokenizer(chat_tokenizer.save(str(tmp_path / "think"), chat_tokenizer.THINKING))
    with pytest.raises(ValueError, match="renders an earlier turn differently once an "
                                         "observation follows it .* set chat_template=FILE"):
        PromptFormat(tok, "chat").observation([{"role": "user", "content": "x"}], after=None)
    fixed = PromptFormat(tok, "chat", chat_template=chat_tokenizer.TEMPLATE)
    assert fixed.observation([{"role": "user", "content": "x"}], after=None)


# -- the python tool -------------------------------------------------------------------------

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (make sandbox-packages)")


@needs_bwrap
def test_the_python_sandbox_holds_its_limits(tmp_path):
    # A generous limit for what must finish (a loaded machine starts interpreters slowly),
    # a short one for what must not.
    sandbox = PythonSandbox(timeout=30.0, memory_mb=256, output_bytes=2000)
    run = lambda code: asyncio.run(sandbox.run({"code": code}))  # noqa: E731
    assert run("print(6 * 7)") == ("42\n", False)
    # Its own directory and an empty /tmp are writable; the standard library imports.
    assert run("import json, sqlite3; open('here.txt', 'w').write('x'); "
               "open('/tmp/t', 'w').write('y'); print(open('here.txt').read(), "
               "__import__('os').listdir('/tmp'))") == ("x ['t']\n", False)
    # No other host file: not the project, not a directory the caller owns, no packages.
    outside = tmp_path / "outside.txt"
    outside.write_text("answer key")
    for code in (f"print(open({str(outside)!r}).read())", f"open({__file__!r})",
                 "import torch", "import megarlhf"):
        text, failed = run(code)
        assert failed and ("No such file" in text or "No module named" in text), (code, text)
    # A listed package directory (here under the host's /tmp, which the sandbox empties)
    # imports, read-only.
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "helper_pkg.py").write_text("ANSWER = 41 + 1\n")
    with_packages = PythonSandbox(timeout=30.0, memory_mb=256, packages=(str(listed),))
    text, failed = asyncio.run(with_packages.run({"code": (
        "import helper_pkg; print(helper_pkg.ANSWER)\n"
        "try:\n    open(helper_pkg.__file__, 'a')\nexcept OSError as e:\n    print(e.errno)")}))
    assert not failed and text.split() in (["42", "30"], ["42", "13"])  # EROFS, or EACCES
    # where the sandbox runs as nobody (under root)
    text, failed = run("import socket; socket.create_connection(('127.0.0.1', 80), timeout=1)")
    assert failed and ("unreachable" in text or "refused" in text), text
    text, failed = run("x = bytearray(512 * 1024 * 1024)")
    assert failed and "MemoryError" in text
    start = time.perf_counter()
    short = PythonSandbox(timeout=2.0, memory_mb=256)
    assert asyncio.run(short.run({"code": "while True: pass"})) == (
        "Error: the program did not finish within 2 s", True)
    assert time.perf_counter() - start < 4
    text, failed = run("print('a' * 10000)")
    assert failed and text == "a" * 2000 + "\n[output cut at 2000 bytes]"
    assert run("") == ("", False)
    assert asyncio.run(sandbox.run({"code": 1}))[1] is True


def _sandboxed_programs() -> int:
    """Processes on the host running a sandboxed program (the interpreter on main.py)."""
    import os

    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                count += f.read().split(b"\0")[1:3] == [b"-s", b"main.py"]
        except OSError:
            pass
    return count


@needs_bwrap
def test_the_python_sandbox_lets_nothing_out():
    """The escape catalogue (escape_probe): reading a file written outside, seeing and
    killing a process started outside, connecting to a socket on the host's 127.0.0.1,
    writing outside, leaving a process behind: none succeeds, and the host's processes are
    untouched. A fork loop stops at the process limit, and when the call returns every
    process it made is gone (none runs on the host any more)."""
    from megarlhf.envs.python_tool import MAX_PROCESSES, check_sandbox, escape_probe

    sandbox = PythonSandbox(timeout=20.0, memory_mb=256)
    leaks, output = escape_probe(sandbox)
    assert leaks == [] and "PROBED" in output, (leaks, output)
    check_sandbox()
    assert _sandboxed_programs() == 0
    start = time.perf_counter()
    text, failed = asyncio.run(sandbox.run({"code": (
        "import os, time\nmade = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        made += 1\n"
        "except OSError as e:\n    print(made, e.errno)\n")}))
    assert not failed and time.perf_counter() - start < 20, text
    made, errno = map(int, text.split())
    # EAGAIN at the limit: the program and the namespace's init (bwrap's) count too
    assert made == MAX_PROCESSES - 2 and errno == 11
    assert _sandboxed_programs() == 0  # not its 62 sleeping children


@needs_bwrap
def test_an_escape_probe_refuses_a_sandbox_that_leaks():
    """A 'sandbox' that runs the code as a plain child process: every attempt leaks, and the
    launch check names each in one line."""
    import sys

    from megarlhf.envs.python_tool import check_sandbox

    class Leaky(PythonSandbox):
        def command(self, work):
            return ["sh", "-c", f"cd {work} && exec {sys.executable} main.py"]

    with pytest.raises(ValueError) as refused:
        check_sandbox(Leaky(timeout=20.0, memory_mb=256))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("tools: the python sandbox leaks here")
    for leak in ("read a file outside it", "saw a process outside it",
                 "killed a process outside it", "connected to a socket on the host's",
                 "wrote outside its working directory", "outlived the call"):
        assert leak in message, (leak, message)


@needs_bwrap
def test_python_calls_run_at_most_python_workers_at_once():
    """12 calls of 0.5 s each through the toolbox with python_workers 3: never more than 3
    interpreters at once (measured from the calls' own start and end times), so 4 waves."""
    box = Toolbox(("python",), timeout=20.0, memory_mb=256, python_workers=3)
    code = "import time; print(time.time()); time.sleep(0.5); print(time.time())"
    calls = [ToolCall("python", {"code": code}) for _ in range(12)]
    results = asyncio.run(box.run(calls))
    spans = [tuple(map(float, text.split())) for text, failed in results if not failed]
    assert len(spans) == 12, results
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most == 3, spans


# -- advantages of episodes, against plain loops ---------------------------------------------

def _episode_batch():
    """4 rows [pad | prompt | turn | observation | turn | pad] with holes in the mask."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0],
                         [0, 1, 1, 0, 0, 0, 0, 1, 0, 0],
                         [0, 0, 0, 1, 1, 1, 1, 0, 0, 0],
                         [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 10, generator=g)
    placed = torch.zeros(4, 10)
    placed[0, 3], placed[0, 8] = 0.5, 1.0  # turn rewards at the turns' last model tokens
    placed[1, 2], placed[1, 7] = 0.25, 0.0
    placed[3, 3] = -1.0
    score = torch.tensor([2.0, 0.25, 1.0, -0.5])  # = placed sums + the part at the end
    return mask, values, placed, score


def _reference_gae(score, placed, values, mask, gamma, lam):
    """A plain loop over each row's model tokens only (observations are not time steps)."""
    advantages = torch.zeros_like(values)
    for b in range(len(mask)):
        steps = [t for t in range(mask.shape[1]) if mask[b, t]]
        rewards = [float(placed[b, t]) for t in steps]
        rewards[-1] += float(score[b] - placed[b].sum())
        running, next_value = 0.0, 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            delta = rewards[i] + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            advantages[b, t] = running
            next_value = float(values[b, t])
    return advantages


def test_gae_on_episodes_skips_observations_and_takes_turn_rewards_where_they_fell():
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.controller import compute_advantages

    mask, values, placed, score = _episode_batch()
    config = PPOConfig(actor="a", critic="c", prompts="p", out_dir="o", reward_fn="m:f",
                       kl_coef=0.0, gamma=0.9, lam=0.8, whiten_advantages=False,
                       prompts_per_step=4)
    exp = {"logp": torch.zeros(4, 10), "ref_logp": torch.zeros(4, 10), "values": values}
    advantages, returns = compute_advantages(config, score, exp, mask, 0.0, placed)
    reference = _reference_gae(score, placed, values, mask, 0.9, 0.8)
    assert torch.allclose(advantages, reference, atol=1e-6)
    assert torch.allclose(returns, torch.where(mask.bool(), reference + values, 0.0),
                          atol=1e-6)
    # Without placement all of the score sits at the last token: a different answer.
    other, _ = compute_advantages(config, score, exp, mask, 0.0, None)
    assert not torch.allclose(other, advantages)


def test_grpo_on_episodes_broadcasts_the_episode_reward_over_model_tokens_only():
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.controller import compute_advantages

    mask, values, placed, score = _episode_batch()
    config = PPOConfig(actor="a", prompts="p", out_dir="o", reward_fn="m:f", algorithm="grpo",
                       samples_per_prompt=2, prompts_per_step=2)
    exp = {"logp": torch.zeros(4, 10), "ref_logp": torch.zeros(4, 10)}
    advantages, returns = compute_advantages(config, score, exp, mask, 0.0, placed)
    assert returns is None
    for b in range(4):  # plain loop: (r - group mean) / (group std + eps) on model tokens
        group = score[(b // 2) * 2:(b // 2) * 2 + 2]
        want = (score[b] - group.mean()) / (group.std() + 1e-6)
        for t in range(10):
            assert float(advantages[b, t]) == pytest.approx(float(want) if mask[b, t] else 0.0,
                                                            abs=1e-6)
