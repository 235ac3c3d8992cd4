"""Engine sessions kept across requests, so a conversation's next turn prefills only what is new.

A `Session` holds the target's KV cache (and the draft model's, or lookup's n-gram index) for
the tokens in `session.tokens`. A request takes the kept session whose tokens share the longest
prefix with its prompt; the engine then trims that session's caches to the common prefix and
feeds the rest. Taking a session that shares only a little (another conversation with the same
system prompt) would throw away that conversation's cache, so a session is reused only when the
new prompt keeps at least half of what it holds, or when it is the one to be evicted anyway.

Memory: each kept session holds about tokens x (target + draft) KV bytes per token, e.g.
2 x layers x kv_heads x head_dim x dtype bytes per model: 57 KiB per token for Qwen2.5-Coder-1.5B
in float32 (28 layers, 2 KV heads of 128), 24 KiB for the 0.5B draft; mlx-lm's caches grow in
steps of 256 tokens and keep their size when trimmed. So the LRU is bounded by count
(`--prompt-cache-size`): at most that many sessions of at most the context window each.
"""

from __future__ import annotations

from ..cached_lm import common_prefix
from ..options import GenerateOptions


class PromptCache:
    def __init__(self, pair, size: int):
        self.pair = pair
        self.size = size
        self.entries: list[tuple[tuple, object]] = []  # (key, Session), least recently used first

    def take(self, ids: list[int], options: GenerateOptions, key: tuple, reuse: bool = True):
        """A session for this prompt: a kept one that shares its prefix, or a new one. The session
        leaves the cache until `put` brings it back."""
        if reuse and self.size > 0:
            best, best_n = None, 0
            for i, (k, s) in enumerate(self.entries):
                n = common_prefix(s.tokens, ids)
                if k == key and n > best_n:
                    best, best_n = i, n
            if best is not None:
                held = len(self.entries[best][1].tokens)
                full = len(self.entries) >= self.size
                if 2 * best_n >= held or (full and best == 0):
                    return self.entries.pop(best)[1]
            if len(self.entries) >= self.size:
                self.entries.pop(0)  # before the new session allocates its caches
        return self.pair.new_session(options)

    def put(self, key: tuple, session) -> None:
        """Keep a session (most recently used), evicting the least recently used beyond the size."""
        if self.size <= 0:
            return
        self.entries.append((key, session))
        del self.entries[: max(len(self.entries) - self.size, 0)]

    def nbytes(self) -> int:
        """Bytes held by the kept sessions' KV caches (target and draft model)."""
        total = 0
        for _, s in self.entries:
            d = s.drafter
            for lm in (s.target, getattr(d, "lm", None), getattr(getattr(d, "model", None), "lm", None)):
                if lm is not None:
                    total += sum(c.nbytes for c in lm.cache if getattr(c, "keys", None) is not None)
        return total
