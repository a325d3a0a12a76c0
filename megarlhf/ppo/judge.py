"""The judge's side in the launching process: its tokenizer and template read and checked
before any rank starts, each sample's judge prompt built and tokenized, the verdicts of the
judge engines (PPOWorker.judge: on the rollout ranks, or on ranks of their own) turned into
scores (megarlhf/rewards/judge.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Iterator, Sequence

import torch

from megarlhf.convert.hf_to_mcore import inspect_hf
from megarlhf.convert.mcore_to_hf import checkpoint_reader
from megarlhf.data.prompts import Prompt
from megarlhf.data.tokenizer import HFTokenizer, eos_token_ids
from megarlhf.engine.checkpoint import (HF_SIDECAR, checkpoint_architecture, is_complete,
                                        read_meta)
from megarlhf.models.arch import hf_shapes
from megarlhf.models.config import ModelConfig
from megarlhf.models.vision import refuse_in_stages
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.rewards.calls import Sample
from megarlhf.rewards.judge import (
    NO_SPELLINGS, SAMPLE_FIELDS, YES_SPELLINGS, JudgeConfig, Verdict, fill, judge_limit,
    template_fields,
)
from megarlhf.rollout.engine import SamplingParams
from megarlhf.rollout.sizing import vllm_head_dim_problem, vllm_token_logprobs_problem


@dataclasses.dataclass(frozen=True)
class JudgeModel:
    """reward_judge.model (or an HF-directory teacher), read: an HF directory, or a Megatron
    checkpoint of a language model (its weights streamed into the judge's Megatron engine, or
    a teacher's frozen model, under their HF names; its tokenizer from the checkpoint's hf/
    sidecar). A checkpoint teacher is loaded as the other roles are, not from here."""

    path: str
    model: ModelConfig
    arch_name: str
    tokenizer_dir: str
    checkpoint: bool
    """A Megatron checkpoint (else an HF directory)."""

    def weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Its tensors under their HF names, one bucket each (an engine's update_weights)."""
        if self.checkpoint:
            from megarlhf.convert.mcore_to_hf import checkpoint_hf_tensors

            return ([item] for item in checkpoint_hf_tensors(self.path))
        source = inspect_hf(self.path)
        return ([(name, source.reader.get(name))]
                for name in hf_shapes(source.rules, source.model))


def judge_model(path: str, field: str = "reward_judge.model") -> JudgeModel:
    """ValueError naming `field` (the recipe field giving `path`) for a path that is neither
    an HF model directory nor a Megatron checkpoint of a language model with its
    tokenizer."""
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            source = inspect_hf(path)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        refuse_in_stages(source.model, f"{field} {path}")
        return JudgeModel(path, source.model, source.arch_name, path, checkpoint=False)
    if not is_complete(path):
        raise ValueError(f"{field} {path} has no config.json and is no complete "
                         f"Megatron checkpoint; give an HF model directory or a checkpoint")
    meta = read_meta(path)
    if meta.get("value_head"):
        raise ValueError(f"{field} {path} is a value model (a critic or reward "
                         f"model: a scalar head); give a language model")
    tokenizer = os.path.join(path, HF_SIDECAR)
    if not os.path.isdir(tokenizer):
        raise ValueError(f"{field} {path} has no {HF_SIDECAR}/ tokenizer sidecar "
                         f"(tools/convert_hf/hf_to_mcore writes one): copy its base model's "
                         f"tokenizer and generation config files into {tokenizer}")
    model, arch = ModelConfig.from_dict(meta["model"]), checkpoint_architecture(meta)
    refuse_in_stages(model, f"{field} {path}")
    reader = checkpoint_reader(path, meta)
    missing = [rule.mcore for rule in arch.rules(model, lm_head=True, value_head=False)
               if reader.shape(rule.mcore) is None]
    if missing:
        raise ValueError(f"{field} {path} has no tensor {missing[0]!r}, which a "
                         f"{arch.name} language model needs (of another architecture?)")
    return JudgeModel(path, model, arch.name, tokenizer, checkpoint=True)


@dataclasses.dataclass
class Judged:
    """A round's judge scores [B], its metrics, the judge's texts, and per sample why it has
    no score (a verdict that could not be read), or None."""

    scores: torch.Tensor
    metrics: dict[str, float]
    texts: list[str]
    failed: list[str | None]


MARKER = "\ue000judge-user-text\ue001"
"""Stands for the judge's user message while its chat template renders: the text around it
is the template's (special tokens recognised), the message itself is encoded with special
tokens split, so a response that spells out "<|im_end|>" cannot end the judge's turn.
Private-use characters, not whitespace: templates that trim the message keep it."""


class Judge:
    def __init__(self, config: JudgeConfig, columns: dict[str, object], *, seed: int,
                 tensor_parallel: int, decode_prompt: Callable[[Sequence[int]], str],
                 longest_sample: int):
        """`columns`: the dataset columns every prompt row has (what else the template may
        name), each with its longest value (ground_truth's too; the judge's prompt must have
        room for them); `decode_prompt`: a pre-tokenized prompt's text, special tokens
        dropped; `longest_sample`: the longest prompt plus max_new_tokens, in the actor's
        tokens (room for {prompt} and {response}, or an episode's {conversation}). ValueError
        naming the field for a judge the run cannot use."""
        self.config, self.seed, self.decode_prompt = config, seed, decode_prompt
        self._calls: dict[int, int] = {}
        source = judge_model(config.model)
        model = source.model
        try:
            model.check_parallel(ParallelConfig(tensor_parallel=tensor_parallel))
        except ValueError as e:
            raise ValueError(f"reward_judge.model: {e}") from None
        if config.backend == "vllm" and config.verdict == "yes_no":
            problem = vllm_token_logprobs_problem()
            if problem:
                raise ValueError(f"reward_judge verdict yes_no on backend vllm: {problem}; "
                                 f"upgrade it, or use backend=megatron")
        if source.checkpoint and config.backend == "vllm":
            raise ValueError(f"reward_judge.backend=vllm reads an HF directory; export "
                             f"{config.model} with tools/convert_hf/mcore_to_hf and give that, "
                             f"or use backend=megatron")
        if config.backend == "vllm":
            problem = vllm_head_dim_problem(model)
            if problem:
                raise ValueError(f"reward_judge.backend=vllm: {problem}; use backend=megatron")
        self.model = model
        """The judge's ModelConfig."""
        self.max_positions = model.max_position_embeddings
        try:
            with open(config.template) as f:
                self.template = f.read()
        except OSError as e:
            raise ValueError(f"reward_judge.template {config.template}: {e.strerror}") from None
        try:
            fields = template_fields(self.template)
        except ValueError as e:
            raise ValueError(f"reward_judge.template {config.template}: {e}") from None
        unknown = sorted(set(fields) - set(SAMPLE_FIELDS) - set(columns))
        if unknown:
            raise ValueError(f"reward_judge.template {config.template} names {unknown}, which "
                             f"are neither {list(SAMPLE_FIELDS)} nor a column of every prompt "
                             f"row ({sorted(columns) or 'none'})")
        if "response" not in fields:
            raise ValueError(f"reward_judge.template {config.template} has no {{response}}: "
                             f"the judge would never see the answer it judges")
        self.tokenizer = HFTokenizer(source.tokenizer_dir)
        if self.tokenizer.vocab_size > model.vocab_size:
            raise ValueError(f"reward_judge.model {config.model}: its tokenizer has "
                             f"{self.tokenizer.vocab_size} ids, its model {model.vocab_size}; "
                             f"give the model's own tokenizer")
        self._trims = False
        self._around = self._chat_around()
        self.stop_ids = eos_token_ids(source.tokenizer_dir) or (self.tokenizer.eos_id,)
        self.verdict = Verdict(config)
        self.candidates: tuple[int, ...] = ()
        self.yes_count = 0
        if config.verdict == "yes_no":
            yes, no = (self._single_tokens(s) for s in (YES_SPELLINGS, NO_SPELLINGS))
            self.candidates, self.yes_count = yes + no, len(yes)
        # The longest judge prompt the run can make: the template with each column's longest
        # value, and room for the sample counted in the actor's tokens (another tokenizer
        # may count differently: each step checks again).
        longest = {name: _text(columns.get(name)) for name in fields}
        longest.update(prompt="", response="", conversation="")
        frame = len(self.prompt_ids(fill(self.template, longest)))
        sample = longest_sample * (("prompt" in fields or "response" in fields)
                                   + ("conversation" in fields))
        need = frame + sample + config.max_new_tokens
        self.longest = need
        """The longest judge prompt plus max_new_tokens the launch foresees (engines are sized
        for it)."""
        self.limit = judge_limit(config, need, self.max_positions)
        """The longest judge prompt plus max_new_tokens its engines take."""
        if need > self.max_positions:
            raise ValueError(f"reward_judge: its prompt (template and columns {frame} tokens, "
                             f"the longest sample {sample}) plus max_new_tokens="
                             f"{config.max_new_tokens} is {need} tokens, over the judge's "
                             f"max_position_embeddings={self.max_positions}; shorten the "
                             f"template, the prompts or max_new_tokens")

    def _chat_around(self) -> tuple[str, str] | None:
        """The judge's chat template around a user message (None: no chat template)."""
        tok = self.tokenizer
        if not tok.has_chat_template:
            return None
        rendered = tok.render_chat([("user", f" {MARKER} ")], add_generation_prompt=True)
        if rendered.count(MARKER) != 1:
            raise ValueError(f"reward_judge.model {self.config.model}: its chat template does "
                             f"not show the user message once as given, so the judge's prompt "
                             f"cannot be built around it")
        # A template that trims the message (Llama 3's, Gemma's) gets the text trimmed.
        self._trims = f" {MARKER} " not in rendered
        spaced = MARKER if self._trims else f" {MARKER} "
        before, after = rendered.split(spaced)
        return before, after

    def _single_tokens(self, spellings: tuple[str, ...]) -> tuple[int, ...]:
        """The distinct ids of those of `spellings` that are one token (a SentencePiece
        tokenizer may split the spaced one)."""
        ids = []
        for spelling in spellings:
            tokens = self.tokenizer.encode(spelling)
            if len(tokens) == 1 and tokens[0] not in ids:
                ids.append(tokens[0])
        if not ids:
            raise ValueError(f"reward_judge.verdict yes_no: the judge's tokenizer has no "
                             f"single token for any of {list(spellings)}; yes_no reads one "
                             f"token's probability (use verdict rating or regex)")
        return tuple(ids)

    def prompt_text(self, prompt: Prompt, sample: Sample) -> str:
        """The judge's user message for one sample."""
        text = prompt.text
        if isinstance(text, tuple):  # messages: the question is the last user turn
            text = next((content for role, content in reversed(text) if role == "user"),
                        None)
        if text is None:
            text = self.decode_prompt(prompt.ids)
        values = {**sample.metadata, "prompt": text, "response": sample.response,
                  "ground_truth": sample.ground_truth}
        return fill(self.template, {name: _text(value) for name, value in values.items()})

    def prompt_ids(self, text: str) -> list[int]:
        """The judge's prompt: `text` as the user message of its chat template (plain, after
        a BOS, without one), special tokens in `text` split into ordinary ones."""
        tok = self.tokenizer
        if self._around is not None and self._trims:
            text = text.strip()
        plain = tok.tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        if self._around is None:
            bos = tok.tok.bos_token_id
            return ([bos] if bos is not None else []) + plain
        before, after = self._around
        return tok.encode(before) + plain + tok.encode(after)

    def params(self, step: int) -> SamplingParams:
        """The judge's sampling settings for its next call in `step`: each call of a step
        (a dynamic-sampling round) its own seed, the same again when the step is rerun."""
        call = self._calls[step] = self._calls.get(step, -1) + 1
        return SamplingParams(max_new_tokens=self.config.max_new_tokens,
                              temperature=self.config.temperature,
                              stop_token_ids=self.stop_ids,
                              seed=(self.seed * 1_000_003 + step + call * 2**32 + _SEED) % 2**63,
                              first_token_candidates=self.candidates)

    def score(self, generate, prompts: list[Prompt], samples: list[Sample],
              step: int) -> Judged:
        """`generate(prompts ids, params)`: the judge engine's completions, one per prompt."""
        start = time.perf_counter()
        ids = [self.prompt_ids(self.prompt_text(p, s)) for p, s in zip(prompts, samples)]
        longest = max(map(len, ids))
        if longest + self.config.max_new_tokens > self.limit:
            what = (f"max_position_embeddings={self.max_positions}"
                    if self.limit == self.max_positions else
                    f"vLLM engines' max_model_len={self.limit} (twice the launch-time bound)")
            raise ValueError(f"reward_judge: a judge prompt of {longest} tokens plus "
                             f"max_new_tokens={self.config.max_new_tokens} exceeds the judge's "
                             f"{what}; shorten the template or the responses "
                             f"(max_new_tokens)")
        completions = generate(ids, self.params(step))
        scores, texts, failed, mass = [], [], [], 0.0
        for c in completions:
            text = self.tokenizer.decode(c.token_ids, skip_special=True)
            value = self.verdict.score(text, c.first_logprobs, self.yes_count)
            if self.candidates:  # yes_no: the share of the first token's mass on a verdict
                mass += sum(math.exp(v) for v in c.first_logprobs)
                # A first token that is neither verdict leaves only the ratio of two tiny
                # probabilities: noise, so no score.
                if c.token_ids[0] not in self.candidates:
                    value = None
            failed.append(None if value is not None else
                          f"reward_judge: no {self.config.verdict} verdict in the judge's "
                          f"text {text[:80]!r}")
            scores.append(0.0 if value is None else value)
            texts.append(text)
        scores = torch.tensor(scores, dtype=torch.float32)
        read = [float(v) for v, f in zip(scores, failed) if f is None]
        metrics = {"reward/judge_parse_failures": float(len(scores) - len(read)),
                   "reward/judge_seconds": time.perf_counter() - start}
        if read:  # over the verdicts read only
            metrics["reward/judge_score"] = sum(read) / len(read)
        if self.candidates:
            metrics["reward/judge_verdict_mass"] = mass / len(completions)
        return Judged(scores, metrics, texts, failed)


def _text(value) -> str:
    """A template value as text: an episode's messages one "role: content" block each."""
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in value)
    return "" if value is None else str(value)


_SEED = 0x5DEECE66D
"""Offset of the judge's seeds from the actor's (a step's first round would share one)."""
