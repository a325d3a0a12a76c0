"""Agent programs for the agent tests, written as users write them: against the `openai`
package's AsyncOpenAI client, importable by module:name (the controller loads them). Each
records what its client received in SEEN (api_key -> list of responses), for the tests that
run the runner in this process."""

from __future__ import annotations

import asyncio
import json

from openai import AsyncOpenAI, AuthenticationError

from megarlhf.envs.verifiers_agent import verifiers_agent

SEEN: dict[str, list] = {}

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def _client(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def _question(row: dict) -> list[dict]:
    prompt = row["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


async def _two_calls(base_url, api_key, model, row):
    client = _client(base_url, api_key)
    messages = _question(row)
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                 logprobs=True, temperature=0.0)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                  logprobs=True)
    SEEN.setdefault(api_key, []).extend([first, second])
    return second.choices[0].message.content or ""


async def two_calls(*, base_url, api_key, model, row):
    """Asks, sends its answer back (as the client's own message object, dumped) with a
    follow-up (its temperature is ignored: the run's applies), and returns 1.0 if the second
    answer is non-empty."""
    return 1.0 if await _two_calls(base_url, api_key, model, row) else 0.0


async def two_calls_by_length(*, base_url, api_key, model, row):
    """two_calls, rewarded by its second answer's length modulo 3 (rewards that differ
    within a group)."""
    return float(len(await _two_calls(base_url, api_key, model, row)) % 3)


async def rewrites(*, base_url, api_key, model, row):
    """Asks, then asks again without its first answer (history rewritten): two chains."""
    client = _client(base_url, api_key)
    first = await client.chat.completions.create(model=model, messages=_question(row),
                                                 max_tokens=8)
    again = [{"role": "system", "content": "Be brief."}, *_question(row)]
    second = await client.chat.completions.create(model=model, messages=again, max_tokens=8)
    SEEN.setdefault(api_key, []).extend([first, second])
    return None


async def two_completions(*, base_url, api_key, model, row):
    """Two /v1/completions calls, the second's prompt the first's + its text + more text,
    a pause between them (the run's weights may move on meanwhile)."""
    client = _client(base_url, api_key)
    first = await client.completions.create(model=model, prompt="Count:", max_tokens=2)
    await asyncio.sleep(0.3)
    await client.completions.create(model=model, prompt="Count:" + first.choices[0].text
                                    + " go on", max_tokens=2)
    return 1.0


async def with_tools(*, base_url, api_key, model, row):
    """Offers the add tool; runs the call the model makes, sends the result back as a tool
    message (its arguments re-serialised with other spacing), asks for the final answer."""
    client = _client(base_url, api_key)
    messages = _question(row)
    first = await client.chat.completions.create(model=model, messages=messages,
                                                 tools=[ADD_TOOL], max_tokens=40)
    message = first.choices[0].message.model_dump(exclude_none=True)
    calls = message.get("tool_calls") or []
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(args, indent=1)  # re-serialised
    messages.append(message)
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": str(args["a"] + args["b"])})
    second = await client.chat.completions.create(model=model, messages=messages,
                                                  tools=[ADD_TOOL], max_tokens=8)
    SEEN.setdefault(api_key, []).extend([first, second])
    return 1.0


async def stops_at_newline(*, base_url, api_key, model, row):
    client = _client(base_url, api_key)
    answer = await client.chat.completions.create(model=model, messages=_question(row),
                                                  max_tokens=20, stop=["\n"])
    SEEN.setdefault(api_key, []).append(answer)
    return 0.5


async def wrong_key(*, base_url, api_key, model, row):
    """Calls with a key of its own making (refused), then with its own."""
    try:
        await _client(base_url, "not-a-key").chat.completions.create(
            model=model, messages=_question(row), max_tokens=4)
    except AuthenticationError as e:
        SEEN.setdefault(api_key, []).append(("refused", e.status_code))
    answer = await _client(base_url, api_key).chat.completions.create(
        model=model, messages=_question(row), max_tokens=4)
    SEEN.setdefault(api_key, []).append(answer)
    return 1.0


async def raises(*, base_url, api_key, model, row):
    await _client(base_url, api_key).chat.completions.create(
        model=model, messages=_question(row), max_tokens=4)
    raise RuntimeError("the agent's own bug")


async def hangs(*, base_url, api_key, model, row):
    await _client(base_url, api_key).chat.completions.create(
        model=model, messages=_question(row), max_tokens=4)
    await asyncio.sleep(3600)


async def many_calls(*, base_url, api_key, model, row):
    """Calls until the endpoint answers with nothing ('length' and no text)."""
    client = _client(base_url, api_key)
    messages = _question(row)
    while True:
        answer = await client.chat.completions.create(model=model, messages=messages,
                                                      max_tokens=4)
        SEEN.setdefault(api_key, []).append(answer)
        choice = answer.choices[0]
        if not choice.message.content and choice.finish_reason == "length":
            return 1.0
        messages += [choice.message.model_dump(), {"role": "user", "content": "More."}]


async def bad_requests(*, base_url, api_key, model, row):
    """Sends what the endpoint refuses, records each status, then asks properly."""
    from openai import APIStatusError

    client = _client(base_url, api_key)
    for bad in ({"stop": [""]}, {"max_tokens": 0}, {"n": 2}, {"messages": []},
                {"tools": ["add"]}):
        try:
            await client.chat.completions.create(
                **{"model": model, "messages": _question(row), **bad})
        except APIStatusError as e:
            SEEN.setdefault(api_key, []).append(e.status_code)
    answer = await client.chat.completions.create(model=model, messages=_question(row))
    SEEN.setdefault(api_key, []).append(answer)
    return 1.0


async def abandons(*, base_url, api_key, model, row):
    """Asks, then gives up on a second call after 0.2 s (its client's own timeout) and
    returns 1.0: the answer it never received must not be trained."""
    client = _client(base_url, api_key)
    messages = _question(row)
    first = await client.chat.completions.create(model=model, messages=messages)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again."}]
    try:
        await asyncio.wait_for(client.chat.completions.create(model=model, messages=messages),
                               0.2)
    except TimeoutError:
        SEEN.setdefault(api_key, []).append("gave up")
    return 1.0


def _two_turn_environment():
    """two_calls_by_length as a verifiers MultiTurnEnv: the model answers, the environment
    says "Sure?", the model answers again (8 new tokens each, the environment's sampling
    arguments); its rubric rewards that second answer's length modulo 3."""
    import verifiers as vf
    from datasets import Dataset

    class TwoTurns(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Sure?"}]

    return TwoTurns(dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "?"}],
                                                "answer": ""}]),
                    max_turns=2, sampling_args={"max_tokens": 8},
                    rubric=vf.Rubric(funcs=[_by_length]))


def single_turn_environment(*reward_funcs, **options):
    """A verifiers SingleTurnEnv scored by `reward_funcs` (`options`: the Environment's)."""
    import verifiers as vf
    from datasets import Dataset

    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"prompt": [{"role": "user",
                                                                    "content": "?"}],
                                                        "answer": ""}]),
                            rubric=vf.Rubric(funcs=list(reward_funcs)), **options)


def _by_length(completion, **_) -> float:
    return float(len(completion[-1].get("content") or "") % 3)


def _broken(completion, **_) -> float:
    raise KeyError("no such field")


def _no_number(completion, **_):
    return None


def _slow_environment():
    """A MultiTurnEnv whose reply takes longer than its own timeout_seconds."""
    import verifiers as vf
    from datasets import Dataset

    class Slow(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            await asyncio.sleep(2.0)
            return [{"role": "user", "content": "Sure?"}]

    return Slow(dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "?"}],
                                            "answer": ""}]),
                max_turns=2, timeout_seconds=0.5, rubric=vf.Rubric(funcs=[_by_length]))


verifiers_two_calls = verifiers_agent(_two_turn_environment)
"""Failures verifiers would score 0.0: a reward function that raises, one that returns no
number, a model call the endpoint refuses (an empty stop string: 400), a rollout past the
environment's timeout."""
verifiers_raising = verifiers_agent(lambda: single_turn_environment(_broken))
verifiers_no_number = verifiers_agent(lambda: single_turn_environment(_no_number))
verifiers_refused_call = verifiers_agent(
    lambda: single_turn_environment(_by_length, sampling_args={"stop": [""]}))
verifiers_timed_out = verifiers_agent(_slow_environment)
