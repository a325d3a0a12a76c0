"""A small ChatML tokenizer for the multi-turn tests, built offline: byte-level BPE (any text
round-trips) in 296 ids, so it fits the toy models' 300-token vocabulary, with the special
tokens of Qwen-style chat (<|im_start|>, <|im_end|>) and a chat template of our own that
renders tools (`tools=`) and merges consecutive tool messages into one user turn of
<tool_response> blocks, as Qwen2.5's does. `THINKING` is the same template rendering the last
assistant turn with an empty <think></think> block and earlier ones without, as Qwen3's does:
an earlier turn changes once an observation follows it."""

from __future__ import annotations

import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 296
CORPUS = [
    "What is 7 + 5? Answer with only the number.", "12", "That is not right. Try again.",
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
    "<tool_response>5</tool_response>", "The answer is 42.", "Hello, how are you?",
    '{"name": "add", "parameters": {"a": 1, "b": 2}}', "Error: there is no tool named",
]

_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' %}
{%- elif m['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user
{% endif %}<tool_response>{{ m['content'] }}</tool_response>
{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>
{% endif %}
{%- elif m['role'] == 'assistant' %}<|im_start|>assistant
{{ THINK }}{{ m['content'] }}<|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TEMPLATE = _TEMPLATE.replace("{{ THINK }}", "")
THINKING = _TEMPLATE.replace("{{ THINK }}", "{% if loop.last %}<think></think>{% endif %}")


def save(directory: str, template: str = TEMPLATE) -> str:
    """Write the tokenizer (with `template`) as an HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   additional_special_tokens=SPECIALS[1:],
                                   chat_template=template)
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory
