"""Stop strings over streamed text: text that might be the start of a stop string is held back
until the next round decides it, so no text past a stop string is ever sent, even when the
stop string is split across two rounds.

    scan = StopScanner(["\\n\\n", "```"])
    scan.feed("def f():\\n")  -> ("def f():", False)     "\\n" may start "\\n\\n": held back
    scan.feed("\\n# done")    -> ("", True)              stop: nothing after it is sent
"""

from __future__ import annotations

from typing import Sequence


class StopScanner:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text not sent yet: it may be the start of a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string ended the output)."""
        buf = self.held + text
        hit = self._first_match(buf)
        start = self._pending_start(buf)
        if hit is not None and (start is None or hit <= start):
            self.held = ""
            return buf[:hit], True
        # a stop string may begin at `start` and end in a later round (one that begins earlier
        # than a complete match wins, so a complete match after it waits too)
        cut = len(buf) if start is None else start
        self.held = buf[cut:]
        return buf[:cut], False

    def finish(self) -> tuple[str, bool]:
        """At the end of generation: the held-back text (cut at a stop string inside it)."""
        buf, self.held = self.held, ""
        hit = self._first_match(buf)
        return (buf, False) if hit is None else (buf[:hit], True)

    def _first_match(self, buf: str) -> int | None:
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _pending_start(self, buf: str) -> int | None:
        """Where the longest tail of buf that is a proper prefix of a stop string begins."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for n in range(min(longest, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stops):
                return len(buf) - n
        return None
