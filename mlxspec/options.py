"""Every option of one generation, in one place.

The Python API takes a `GenerateOptions` (or keyword changes to the defaults, checked against
its fields), the CLI builds one from its flags (`cli_options.py`) and the server from a request
body, so a new option is added here once and reaches all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .adaptive import DEFAULT_DRAFT_MAX, AdaptiveLength, FixedLength
from .sampling import SamplingParams


@dataclass(frozen=True)
class GenerateOptions:
    # length and sampling (one function turns logits into the distribution: sampling.py)
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # who drafts (drafters/__init__.py) and how much (adaptive.py)
    drafter: str = "auto"  # "auto", "model", "lookup", "model+lookup", "none", ...
    num_draft: int = 4  # tokens per round; with adaptive, only the first round's
    adaptive: bool = False  # follow the recent acceptance within [draft_min, draft_max]
    draft_min: int = 1
    draft_max: int | None = None  # default: 16 with adaptive, else num_draft
    draft_p_min: float | None = None  # stop a model draft below this top probability
    ngram_min: int = 1  # prompt lookup's n-gram sizes
    ngram_max: int = 4
    draft_vocab: int = 0  # draft among the N most frequent token ids only (0: all; drafters/model.py)
    tree_nodes: int = 0  # > 0: draft token trees of up to this many nodes (model, suffix; tree.py); 0: chains
    suffix_cache_tokens: int = 100_000  # suffix drafter: earlier outputs kept, oldest evicted first
    profile: bool = False  # split draft and verify time (one more host wait per round)

    def __post_init__(self) -> None:
        from .drafters import DRAFTERS

        self.sampling  # validates temperature, top_p, top_k, min_p
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {self.num_draft}")
        if self.draft_min < 1:
            raise ValueError(f"draft_min must be >= 1, got {self.draft_min}")
        if self.draft_max is not None and self.draft_max < self.draft_min:
            raise ValueError(f"draft_max ({self.draft_max}) must be >= draft_min ({self.draft_min})")
        if self.draft_p_min is not None and not 0.0 < self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in (0, 1], got {self.draft_p_min}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: the full vocabulary), got {self.draft_vocab}")
        if self.tree_nodes < 0:
            raise ValueError(f"tree_nodes must be >= 0 (0: chains), got {self.tree_nodes}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def speculates(self) -> bool:
        """Whether these options ask for drafting at all (the pair may still have no drafter)."""
        return self.drafter != "none" and (self.num_draft > 0 or self.adaptive)

    def length_policy(self, costs: dict[str, float]) -> AdaptiveLength | FixedLength:
        if self.adaptive:
            hi = self.draft_max if self.draft_max is not None else max(DEFAULT_DRAFT_MAX, self.draft_min)
            return AdaptiveLength(self.draft_min, hi, first=self.num_draft, costs=costs)
        return FixedLength(min(self.num_draft, self.draft_max or self.num_draft))

    def replace(self, **changes) -> "GenerateOptions":
        """A copy with some fields changed; an unknown name is a TypeError that lists the known ones."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown generation option(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes) if changes else self


FIELDS = tuple(f.name for f in dataclasses.fields(GenerateOptions))


def resolve(options: GenerateOptions | None, changes: dict) -> GenerateOptions:
    """The options of one call: `options` (or the defaults) with the call's keyword changes."""
    return (options or GenerateOptions()).replace(**changes)
