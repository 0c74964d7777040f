"""A conversation as prompt token ids, through the model's chat template.

What a client wrote stays text: a control token typed in a message ("<|im_end|>\\n<|im_start|>
system...") becomes the tokens of its characters, so it cannot end a turn or open a system
turn; only the control tokens the template writes itself are control tokens. transformers'
`sanitize_control_tokens` does this (it marks the control tokens in every string of the
messages and tools before rendering, and encodes the marked ones as plain text); a prompt
without control-token strings gets exactly the ids `apply_chat_template` gives. Dict keys
are not marked, so a key holding a control token (in a tool's schema or a call's arguments)
is refused.

With a limit, a prompt is refused before it is tokenized when the rendered text alone shows
it is too long (engine/token_floor.py): rendering is a string join, tokenizing is the cost.
"""

from __future__ import annotations

import re
from functools import cached_property

from engine.token_floor import TokenFloor


class PromptTooLong(Exception):
    """The rendered prompt takes at least `at_least` tokens, more than `limit`."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the prompt is at least {at_least} tokens (counted before tokenizing it); the limit is "
                         f"{limit}")
        self.at_least = at_least
        self.limit = limit


class ChatTemplate:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        tokens = sorted((token.content for token in tokenizer.added_tokens_decoder.values()
                         if token.content and not token.content.isspace()), key=len, reverse=True)
        self._added_tokens = re.compile("|".join(map(re.escape, tokens))) if tokens else None

    @cached_property
    def floor(self) -> TokenFloor | None:
        """The fewest tokens a text can take (None: this tokenizer has no sound floor)."""
        return TokenFloor.of(self.tokenizer)

    def token_ids(self, messages: list[dict], max_tokens: int | None = None, **template_kwargs) -> list[int]:
        """The conversation's prompt, ending with the assistant's turn opened. Raises
        PromptTooLong (before tokenizing) when the prompt surely exceeds `max_tokens`, and
        ValueError for a conversation it cannot render (as the template itself does)."""
        self._refuse_control_tokens_in_keys([messages, template_kwargs.get("tools")])
        if max_tokens is not None and self.floor is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **template_kwargs)
            at_least = self.floor.tokens(text)
            if at_least > max_tokens:
                raise PromptTooLong(at_least, max_tokens)
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False, sanitize_control_tokens=True,
                                                       **template_kwargs))

    def _refuse_control_tokens_in_keys(self, value) -> None:
        if self._added_tokens is None:
            return
        pending = [value]  # a stack, not recursion: client JSON may nest as deep as the parser allows
        while pending:
            item = pending.pop()
            if isinstance(item, dict):
                for key in item:
                    found = self._added_tokens.search(key) if isinstance(key, str) else None
                    if found is not None:
                        raise ValueError(f"a key of the tools or of a tool call's arguments holds the model's "
                                         f"control token {found.group()!r}")
                pending += item.values()
            elif isinstance(item, (list, tuple)):
                pending += item
