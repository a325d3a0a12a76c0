"""The real-model tier's verifiable task: capital-city questions as chat-message prompt rows
with the city as ground truth, and a batched text-level reward (1.0 when the answer names the
city). The rows go through `prompts=` as a user's dataset would: the run applies the model's
chat template itself."""

from __future__ import annotations

import json

TRAIN = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Spain": "Madrid",
         "Germany": "Berlin", "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima"}
HELD_OUT = {"Greece": "Athens", "Norway": "Oslo", "Kenya": "Nairobi", "Chile": "Santiago"}


def question(country: str) -> str:
    return f"What is the capital of {country}? Answer in a few words."


def write_prompts(path: str, capitals: dict[str, str]) -> str:
    """One chat-message row per country, with its capital as ground truth."""
    with open(path, "w") as f:
        for country, city in capitals.items():
            f.write(json.dumps({"prompt": [{"role": "user", "content": question(country)}],
                                "ground_truth": city, "data_source": "capitals"}) + "\n")
    return path


def capital_reward(responses: list[str], ground_truths: list[str]) -> list[float]:
    return [float(city.lower() in text.lower()) for text, city in zip(responses, ground_truths)]
