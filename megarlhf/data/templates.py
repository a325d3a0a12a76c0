"""Prompt, response and observation token ids in one of two formats.

'chat': the tokenizer's chat template (or a Jinja template given instead). The response is
what the template adds after the prompt rendered with its generation prompt, so end-of-turn
tokens come from the template.
'plain': ' Human: {prompt} Assistant:' (turns of a message list in the same style), BOS before
the prompt when the tokenizer has one, and the response ' {response}' followed by EOS.

Multi-turn episodes (megarlhf/envs) keep the model's turns as the engine sampled them and add
what an environment answers as tokens of its own (`observation`): the template is rendered
over a fixed conversation with and without the answer, and the difference taken; it must
render the earlier turns the same either way.

Tools: with `tools` (JSON schemas), a template that takes tools gets them (`tools=`); for one
that ignores them they go into a system message (`tool_instructions`), first in the
conversation.
"""

from __future__ import annotations

from megarlhf.data.records import Message
from megarlhf.data.tokenizer import Tokenizer

PLAIN_ROLES = {"system": "System", "user": "Human", "assistant": "Assistant", "tool": "Tool"}
_USER = {"role": "user", "content": "Hi"}
_ASSISTANT = {"role": "assistant", "content": "Hello"}
"""The fixed turns observations are rendered after (their text only has to survive the
template unchanged)."""


def plain_prompt(prompt: str | tuple[Message, ...] | list) -> str:
    turns = "".join(f" {PLAIN_ROLES[m['role']]}: {m['content'].strip()}"
                    for m in _messages(prompt))
    return f"{turns} {PLAIN_ROLES['assistant']}:"


def _messages(prompt) -> list[dict]:
    """A prompt (text, (role, content) pairs, or message dicts) as message dicts."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in prompt]


class PromptFormat:
    def __init__(self, tokenizer: Tokenizer, template: str, *, tools: list[dict] | None = None,
                 tool_instructions: str | None = None, chat_template: str | None = None):
        """`chat_template`: Jinja text used instead of the tokenizer's (HF tokenizers)."""
        has_template = tokenizer.has_chat_template or chat_template is not None
        if template == "chat" and not has_template:
            raise ValueError(f"template: chat, but {tokenizer} has no chat template; use "
                             f"template: plain or auto")
        if tools and tool_instructions is None:
            raise ValueError("tools need tool_instructions for templates that ignore them")
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.chat = template == "chat" or (template == "auto" and has_template)
        self.tools, self.tool_instructions = tools or None, tool_instructions
        self._template_takes_tools: bool | None = None
        self._frame: tuple[str, str] | None = None

    @property
    def name(self) -> str:
        return "chat" if self.chat else "plain"

    def prompt(self, prompt: str | tuple[Message, ...] | list[dict]) -> list[int]:
        """Token ids of a prompt (text, (role, content) pairs, or message dicts) up to the
        model's turn."""
        if self.chat:
            return self.tokenizer.encode(self._render(_messages(prompt), None))
        return self.tokenizer.encode(plain_prompt(self._with_tool_system(_messages(prompt))),
                                     add_bos=True)

    def response(self, prompt: str | tuple[Message, ...], response: str) -> list[int]:
        if not self.chat:
            return self.tokenizer.encode(f" {response.strip()}") + [self.tokenizer.eos_id]
        messages = _messages(prompt)
        head = self._render(messages, None)
        full = self._render(messages, response)
        if not full.startswith(head):
            raise ValueError(
                f"{self.tokenizer}'s chat template renders a conversation that does not start "
                f"with its own prompt (with generation prompt), so the response cannot be cut "
                f"out of it; use template: plain")
        return self.tokenizer.encode(full[len(head):])

    def observation(self, messages: list[dict], *, after: int | None) -> list[int]:
        """Token ids that follow a model turn and lead into the next one: what the template
        puts after the model's text (its end-of-turn, a newline), `messages` (an
        environment's answer: user or tool messages), and the next turn's generation prompt.
        `after`: the token the turn ended on (None when it was cut at its length): when the
        ids start with it, the model emitted it and it is not repeated."""
        if self.chat:
            before, tail = self._turn_frame()
            with_answer = self._render([_USER, _ASSISTANT, *messages], None)
            if not with_answer.startswith(before):
                raise ValueError(
                    f"{self.tokenizer}'s chat template renders an earlier turn differently "
                    f"once an observation follows it (Qwen3's drops earlier <think> blocks, "
                    f"for one), so the observation cannot be cut out of the conversation as "
                    f"tokens; set chat_template=FILE to a template that renders earlier turns "
                    f"unchanged, or template: plain")
            ids = self.tokenizer.encode(tail + with_answer[len(before):])
        else:
            turns = plain_prompt(messages)
            ids = [self.tokenizer.eos_id] + self.tokenizer.encode(turns)
        if after is not None and ids and ids[0] == after:
            ids = ids[1:]
        return ids

    def _turn_frame(self) -> tuple[str, str]:
        """(the fixed conversation rendered through the model's turn, what the template puts
        after the model's text in it)."""
        if self._frame is None:
            asking = self._render([_USER], None)
            answered = self._render([_USER, _ASSISTANT], None, generation_prompt=False)
            at = answered.find(_ASSISTANT["content"], len(asking))
            if not answered.startswith(asking) or at < 0:
                raise ValueError(f"{self.tokenizer}'s chat template does not render a model "
                                 f"turn after its own generation prompt; use template: plain")
            self._frame = answered, answered[at + len(_ASSISTANT["content"]):]
        return self._frame

    def _render(self, messages: list[dict], response: str | None, *,
                generation_prompt: bool | None = None) -> str:
        """The conversation; with `response`, followed by it as the model's turn. Without,
        ending in the generation prompt unless `generation_prompt` is False."""
        if response is not None:
            messages = messages + [{"role": "assistant", "content": response}]
        if generation_prompt is None:
            generation_prompt = response is None
        tools = None
        if self.tools:
            if self._takes_tools():
                tools = self.tools
            else:
                messages = self._with_tool_system(messages)
        return self.tokenizer.render_chat(messages, add_generation_prompt=generation_prompt,
                                          tools=tools, chat_template=self.chat_template)

    def _takes_tools(self) -> bool:
        """Whether the template renders `tools=` (a template that ignores them renders the
        same text with and without)."""
        if self._template_takes_tools is None:
            render = lambda tools: self.tokenizer.render_chat(  # noqa: E731
                [_USER], add_generation_prompt=True, tools=tools,
                chat_template=self.chat_template)
            self._template_takes_tools = render(self.tools) != render(None)
        return self._template_takes_tools

    def _with_tool_system(self, messages: list[dict]) -> list[dict]:
        """`messages` with the tool instructions in a system message, first (added to the
        conversation's own system message when it has one)."""
        if not self.tools:
            return messages
        if messages and messages[0]["role"] == "system":
            first = {**messages[0],
                     "content": f"{messages[0]['content']}\n\n{self.tool_instructions}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.tool_instructions}, *messages]
