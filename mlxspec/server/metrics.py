"""Totals since the server started, for `GET /metrics` (Prometheus' text format)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass
class Metrics:
    requests: int = 0  # generations finished (stopped, length, or cancelled)
    requests_cancelled: int = 0  # the client went away
    requests_rejected: int = 0  # the queue was full
    requests_failed: int = 0  # the engine raised
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    draft_tokens: int = 0
    draft_tokens_accepted: int = 0
    target_passes: int = 0  # target forward passes after the prefills
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **amounts) -> None:
        with self._lock:
            for name, n in amounts.items():
                setattr(self, name, getattr(self, name) + n)

    def text(self, gauges: dict[str, float]) -> str:
        with self._lock:
            lines = []
            for f in fields(self):
                lines += [f"# TYPE mlxspec_{f.name}_total counter", f"mlxspec_{f.name}_total {getattr(self, f.name)}"]
            for name, value in gauges.items():
                lines += [f"# TYPE mlxspec_{name} gauge", f"mlxspec_{name} {value}"]
        return "\n".join(lines) + "\n"
