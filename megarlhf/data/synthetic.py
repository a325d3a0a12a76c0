"""Demo data made by code: SFT demonstrations, preference pairs and prompts about everyday
topics, plus the text to train a tokenizer on. Deterministic for a given seed.

The learnable preference: a chosen response describes the topic with warm words
('wonderful', 'peaceful', ...), its rejected twin says the same with cold ones ('dull',
'gloomy', ...). SFT responses are warm or cold at random, so a fine-tuned policy starts near
50% warm and PPO against a reward model trained on the pairs has room to raise it.
"""

from __future__ import annotations

import json
import os
import random

from megarlhf.data.embedded import TEXT
from megarlhf.data.templates import plain_prompt

TOPICS = ("the sea", "a garden", "the city", "music", "the mountains", "winter", "a library",
          "the river", "coffee", "the forest", "a train ride", "the desert", "spring",
          "the market", "a storm", "the night sky", "a bakery", "the harbour", "snow",
          "the museum", "a lake", "the village", "autumn", "a bridge")
WARM = ("wonderful", "lovely", "bright", "peaceful", "delightful", "beautiful", "cheerful",
        "pleasant", "warm", "charming")
COLD = ("dull", "gloomy", "noisy", "dreary", "boring", "grim", "dirty", "awful", "cold",
        "bleak")
PROMPTS = ("Tell me about {t}.", "What do you think of {t}?", "Describe {t}.",
           "How is {t} today?", "Say something about {t}.")
RESPONSES = ("{T} is {a} and {b}.", "I find {t} {a}, even {b}.", "{T} feels {a} and {b}.",
             "To me {t} is {a} and a little {b}.")


def _response(rng: random.Random, topic: str, words: tuple[str, ...], shape: str) -> str:
    a, b = rng.sample(words, 2)
    return shape.format(t=topic, T=topic[0].upper() + topic[1:], a=a, b=b)


def _prompt(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(TOPICS)
    return topic, rng.choice(PROMPTS).format(t=topic)


def sft_records(n: int, *, seed: int = 0) -> list[dict]:
    """{prompt, response}: half the responses warm, half cold."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic, prompt = _prompt(rng)
        words = WARM if rng.random() < 0.5 else COLD
        out.append({"prompt": prompt,
                    "response": _response(rng, topic, words, rng.choice(RESPONSES))})
    return out


def preference_records(n: int, *, seed: int = 1) -> list[dict]:
    """{prompt, chosen, rejected}: the same sentence shape, warm (chosen) vs cold words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic, prompt = _prompt(rng)
        shape = rng.choice(RESPONSES)
        out.append({"prompt": prompt, "chosen": _response(rng, topic, WARM, shape),
                    "rejected": _response(rng, topic, COLD, shape)})
    return out


def prompt_records(n: int, *, seed: int = 2) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _prompt(rng)[1]} for _ in range(n)]


def is_warm(text: str) -> bool:
    """Whether `text` uses more warm than cold words (the demo's measure of alignment)."""
    words = text.lower().replace(".", " ").replace(",", " ").split()
    return sum(w in WARM for w in words) > sum(w in COLD for w in words)


def tokenizer_corpus(*, seed: int = 3) -> list[str]:
    """Lines covering every word the records above can contain, in the plain prompt format,
    and the embedded prose."""
    lines = [line for line in TEXT.splitlines() if line.strip()]
    for rec in sft_records(1000, seed=seed) + preference_records(500, seed=seed + 1):
        for key in ("response", "chosen", "rejected"):
            if key in rec:
                lines.append(f"{plain_prompt(rec['prompt'])} {rec[key]}")
    return lines


ARITHMETIC = {
    # data source: (question shape, left operands, right operands, answer)
    "addition": ("What is {a} + {b}?", range(1, 10), range(1, 10), lambda a, b: a + b),
    "subtraction": ("What is {a} - {b}?", range(11, 20), range(1, 10), lambda a, b: a - b),
    "multiplication": ("What is {a} times {b}?", range(2, 10), range(2, 10),
                       lambda a, b: a * b),
}
ANSWER_FORMAT = " Answer with only the number."


def arithmetic_records(*, held_out: int, seed: int = 4) -> tuple[list[dict], list[dict]]:
    """Every one-digit arithmetic question of ARITHMETIC as prompt rows with the answer as
    ground truth and the operation as data source, shuffled and split into (train, held-out):
    `held_out` questions, an equal share of each operation, none of them in train. The task
    of the real-model GRPO recipe (recipes/smollm2-135m-grpo-arithmetic.yaml)."""
    rng = random.Random(seed)
    train, val = [], []
    for source, (shape, left, right, answer) in ARITHMETIC.items():
        rows = [{"prompt": shape.format(a=a, b=b) + ANSWER_FORMAT,
                 "ground_truth": str(answer(a, b)), "data_source": source}
                for a in left for b in right]
        rng.shuffle(rows)
        share = held_out // len(ARITHMETIC) + (source == "addition") * (held_out % len(ARITHMETIC))
        val += rows[:share]
        train += rows[share:]
    rng.shuffle(train)
    return train, val


def arithmetic_pairs(rows: list[dict], *, seed: int) -> list[dict]:
    """Preference pairs from `arithmetic_records` rows: each question with its answer chosen
    and a wrong number 1-3 away (not negative) rejected. The data of the real-model DPO recipe
    (recipes/smollm2-135m-dpo-arithmetic.yaml)."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        right = int(row["ground_truth"])
        wrong = right + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if right + d >= 0])
        out.append({"prompt": row["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return out


def write_jsonl(records: list[dict], path: str) -> str:
    """`records` as JSON lines at `path` (its directory made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path


TOOL_SHOTS = ((12, 34), (56, 7), (81, 9))
"""Worked examples in every tool-arithmetic prompt: a question, the calculator call, its
result, the answer."""


def tool_arithmetic_records(*, rows: int, held_out: int, seed: int = 5
                            ) -> tuple[list[dict], list[dict]]:
    """Two-digit multiplications a small model cannot do in its head, as chat rows for the
    built-in tools environment with megarlhf.envs.calculator: each prompt holds three worked
    examples (question, a hermes-format calculator call, the tool's result, the answer), then
    the question; ground truth the product. (train, held-out) with distinct questions."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(11, 100) for b in range(11, 100)],
                       rows + held_out)
    out = []
    for a, b in pairs:
        messages = []
        for x, y in TOOL_SHOTS:
            call = json.dumps({"name": "calculator", "arguments": {"expression": f"{x} * {y}"}})
            messages += [{"role": "user", "content": f"What is {x} times {y}?"},
                         {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                         {"role": "tool", "content": str(x * y)},
                         {"role": "assistant", "content": str(x * y)}]
        messages.append({"role": "user", "content": f"What is {a} times {b}?"})
        out.append({"prompt": messages, "ground_truth": str(a * b),
                    "data_source": "tool_multiplication"})
    return out[:rows], out[rows:]
