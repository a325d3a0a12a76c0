"""The calculator task of recipes/smollm2-135m-grpo-tools.yaml as a `verifiers` environment
(a `ToolEnv` with the calculator tool and a rubric checking the final answer), trained with
`agent: megarlhf.envs.calculator_verifiers:solve` (docs/guides/agents.md). Any classic
verifiers environment is trained the same way: `verifiers_agent(its load_environment)`.
Needs `verifiers` (tested with 0.3.1) and `datasets`."""

from __future__ import annotations

from megarlhf.envs.calculator import calculator
from megarlhf.envs.verifiers_agent import verifiers_agent
from megarlhf.rewards.builtin import math_reward


def correct_answer(completion, answer, **_) -> float:
    """1.0 when the last assistant message's final answer equals `answer` (the built-in
    `math` reward's rule)."""
    said = [m for m in completion if m.get("role") == "assistant" and m.get("content")]
    return math_reward([said[-1]["content"] if said else ""], [answer])["scores"][0]


SYSTEM = "Use the calculator tool for arithmetic, then reply with the number alone."


def records(*, rows: int, held_out: int) -> tuple[list[dict], list[dict]]:
    """The tools recipe's questions as this environment's rows (train, held-out): a system
    prompt and the question, ground truth the product. (The recipe's rows also hold worked
    examples with tool messages, which megarlhf rows keep as role and text only, and
    verifiers requires a tool message's `tool_call_id`.)"""
    from megarlhf.data.synthetic import tool_arithmetic_records

    def row(r: dict) -> dict:
        return {"prompt": [{"role": "system", "content": SYSTEM}, r["prompt"][-1]],
                "ground_truth": r["ground_truth"]}

    train, val = tool_arithmetic_records(rows=rows, held_out=held_out)
    return [row(r) for r in train], [row(r) for r in val]


def load_environment(max_turns: int = 3):
    """A ToolEnv with the calculator and the answer check (its dataset is verifiers' own
    record of the task, required to build one; what each episode answers is the run's row)."""
    import verifiers as vf
    from datasets import Dataset

    train, _ = records(rows=8, held_out=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["ground_truth"]}
                                 for r in train])
    return vf.ToolEnv(dataset=dataset, tools=[calculator], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[correct_answer]))


solve = verifiers_agent(load_environment)
