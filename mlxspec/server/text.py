"""Generated tokens to text, in pieces whose concatenation is `tokenizer.decode(tokens)`.

mlx-lm's streaming detokenizers drop the first space of a reply (right after "assistant\\n", but
wrong for a completion: `def f():\\n` + "    return" would lose an indent), so the server decodes
for itself: each piece is the decode of the open segment after one context token, minus what was
sent; a segment closes at a newline or after `window` tokens, so decoding stays linear. Text that
ends in an incomplete UTF-8 character ("\\ufffd") waits for the next token.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, window: int = 16):
        self.tokenizer = tokenizer
        self.window = window
        self.tokens: list[int] = []  # the context token (after the first segment), then the segment
        self.context = ""  # the decode of the context token
        self.sent = 0  # characters of the segment's text already returned

    def add(self, tokens: Sequence[int]) -> str:
        self.tokens += tokens
        text = self._segment()
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        if end == len(text) and (text.endswith("\n") or len(self.tokens) > self.window):
            self.tokens = self.tokens[-1:]  # a new segment, decoded after its context token
            self.context = self.tokenizer.decode(self.tokens)
            self.sent = 0
        return piece

    def finish(self) -> str:
        """What is still held back (an incomplete character stays a replacement character)."""
        text = self._segment()
        piece = text[self.sent:]
        self.sent = len(text)
        return piece

    def _segment(self) -> str:
        return self.tokenizer.decode(self.tokens)[len(self.context):]
