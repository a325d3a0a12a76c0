"""Prompt and response token ids in one of two formats.

'chat': the tokenizer's chat template. The response is what the template adds after the
prompt rendered with its generation prompt, so end-of-turn tokens come from the template.
'plain': ' Human: {prompt} Assistant:' (turns of a message list in the same style), BOS before
the prompt when the tokenizer has one, and the response ' {response}' followed by EOS.
"""

from __future__ import annotations

from megarlhf.data.records import Message
from megarlhf.data.tokenizer import Tokenizer

PLAIN_ROLES = {"system": "System", "user": "Human", "assistant": "Assistant"}


def plain_prompt(prompt: str | tuple[Message, ...]) -> str:
    messages = (("user", prompt),) if isinstance(prompt, str) else prompt
    turns = "".join(f" {PLAIN_ROLES[role]}: {content.strip()}" for role, content in messages)
    return f"{turns} {PLAIN_ROLES['assistant']}:"


class PromptFormat:
    def __init__(self, tokenizer: Tokenizer, template: str):
        if template == "chat" and not tokenizer.has_chat_template:
            raise ValueError(f"template: chat, but {tokenizer} has no chat template; use "
                             f"template: plain or auto")
        self.tokenizer = tokenizer
        self.chat = template == "chat" or (template == "auto" and tokenizer.has_chat_template)

    @property
    def name(self) -> str:
        return "chat" if self.chat else "plain"

    def prompt(self, prompt: str | tuple[Message, ...]) -> list[int]:
        if self.chat:
            return self.tokenizer.encode(self._render(prompt, None))
        return self.tokenizer.encode(plain_prompt(prompt), add_bos=True)

    def response(self, prompt: str | tuple[Message, ...], response: str) -> list[int]:
        if not self.chat:
            return self.tokenizer.encode(f" {response.strip()}") + [self.tokenizer.eos_id]
        head = self._render(prompt, None)
        full = self._render(prompt, response)
        if not full.startswith(head):
            raise ValueError(
                f"{self.tokenizer}'s chat template renders a conversation that does not start "
                f"with its own prompt (with generation prompt), so the response cannot be cut "
                f"out of it; use template: plain")
        return self.tokenizer.encode(full[len(head):])

    def _render(self, prompt, response: str | None) -> str:
        messages = [("user", prompt)] if isinstance(prompt, str) else list(prompt)
        if response is None:
            return self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return self.tokenizer.render_chat(messages + [("assistant", response)],
                                          add_generation_prompt=False)
