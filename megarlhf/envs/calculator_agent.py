"""The calculator task of recipes/smollm2-135m-grpo-tools.yaml written as an agent program
(`agent: megarlhf.envs.calculator_agent:solve`, recipes/smollm2-135m-grpo-agent.yaml): plain
`openai` client code, as an agent written for any OpenAI-compatible server is. It offers the
calculator as a tool, runs the calls the model makes, sends each result back as a tool
message, and stops at the first answer without a call; the run's `math` reward scores that
answer (the program returns None). Needs the `openai` package."""

from __future__ import annotations

import json

from transformers.utils import get_json_schema

from megarlhf.envs.calculator import calculator

CALCULATOR = get_json_schema(calculator)
"""The calculator's tool schema, as `environment: tools` gives it."""
TURN_TOKENS = 40
"""New tokens per call (the episode's budget is the run's max_new_tokens)."""


async def solve(*, base_url: str, api_key: str, model: str, row: dict,
                max_calls: int = 3) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for _ in range(max_calls):
        answer = await client.chat.completions.create(model=model, messages=messages,
                                                      tools=[CALCULATOR],
                                                      max_tokens=TURN_TOKENS)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # the model's call: answered, as the tools environment does
                result = f"Error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
