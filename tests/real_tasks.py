"""A verifiable reward for the real-model tier (importable by the controller): capital-city
questions, rewarded 1.0 when the answer names the right city. The checker reads the country from
the prompt's text, so the prompts file needs nothing but token ids."""

from __future__ import annotations

import functools
import os

CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Spain": "Madrid",
            "Germany": "Berlin", "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima"}
TOKENIZER_ENV = "MEGARLHF_TEST_TOKENIZER"
"""An HF tokenizer directory: the reward decodes prompts and answers with it."""


def question(country: str) -> str:
    return f"What is the capital of {country}? Answer in a few words."


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from megarlhf.data.tokenizer import load_tokenizer

    return load_tokenizer(os.environ[TOKENIZER_ENV])


def capital_reward(prompt_ids: list[int], response_ids: list[int]) -> float:
    tokenizer = _tokenizer()
    prompt = tokenizer.decode(prompt_ids)
    (country,) = [c for c in CAPITALS if f"capital of {c}?" in prompt]
    return float(CAPITALS[country].lower() in tokenizer.decode(response_ids).lower())
