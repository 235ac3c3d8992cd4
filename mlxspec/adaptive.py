"""How many tokens to draft next round.

Any draft length chosen from what happened in earlier rounds keeps decoding exact: acceptance
at each position reproduces the target's distribution whatever the length, and the choice does
not look at this round's target output. So the length can follow the acceptance freely.

The adaptive rule (`AdaptiveLength`), per key: the proposer, and for lookup the length of its
match ("model", "lookup/1" ... "lookup/4"): the model and lookup accept very differently, and a
4-token match copies on for much longer than a 1-token one, so each keeps its own estimate:

1. Estimate a, the probability that a drafted token is accepted given that the ones before it
   were. A round that drafts k tokens and accepts n tested n + 1 tokens (n successes, one
   rejection) when n < k, and k tokens (all successes) when n = k. a is the ratio of two
   exponentially decayed sums, of successes and of tests, with decay `decay` per round (0.8: the
   last ~5 rounds dominate) and a prior worth `prior_weight` tests at `prior`.
2. With acceptance a per token, a round that drafts k tokens emits on average
   E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens, and costs one target step plus k
   drafted-and-verified tokens, each `cost` target steps (the drafter's own cost per token,
   0 for lookup and about the draft/target weight ratio for a draft model, plus
   `VERIFY_COST` for the wider verification pass). Draft the longest k in [draft_min,
   draft_max] whose E(k) / (1 + cost * k), the expected tokens per unit of time, is within
   `SLACK` (3%) of the best: real acceptance comes in runs (a draft on track stays on track),
   so the geometric model underrates longer drafts, and near its optimum the curve is flat.

So a pair accepting 90% of its tokens drafts long (a = 0.9: k = 4 at a total cost of 0.4 per
token, e.g. a 0.5B draft for a 1.5B target; k = 10 at 0.1, e.g. lookup),
one accepting 30% drafts short (k = draft_min), and no `num_draft` needs tuning: it is only the
length of a proposer's first round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERIFY_COST = 0.1  # extra cost of verifying one more token, in target steps (CPU/OpenBLAS: 0.03-0.15)
DEFAULT_DRAFT_MAX = 16  # the adaptive rule's upper bound when none is given
SLACK = 0.03  # take the longest draft within this fraction of the best predicted rate


def expected_tokens(a: float, k: int) -> float:
    """Mean tokens emitted by a round drafting k tokens, each accepted with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_length(a: float, cost: float, k_min: int, k_max: int, slack: float = SLACK) -> int:
    """The longest k in [k_min, k_max] whose E(k) / (1 + cost * k) is within `slack` of the
    maximum over that range."""
    rate = {k: expected_tokens(a, k) / (1.0 + cost * k) for k in range(k_min, k_max + 1)}
    top = max(rate.values())
    return max(k for k, v in rate.items() if v >= top * (1.0 - slack) - 1e-12)


class FixedLength:
    """Draft the same number of tokens every round."""

    def __init__(self, k: int):
        self.length = k

    def k(self, source: str) -> int:
        return self.length

    def update(self, source: str, k: int, n: int) -> None:
        pass


@dataclass
class _Estimate:
    successes: float
    tests: float
    rounds: int = 0

    @property
    def a(self) -> float:
        return self.successes / self.tests


@dataclass
class AdaptiveLength:
    """The rule in this module's docstring. `costs` maps a proposer ("model", "lookup") to its
    own cost per drafted token in target steps (a key "lookup/3" costs what "lookup" does;
    unknown proposers cost 0)."""

    draft_min: int = 1
    draft_max: int = DEFAULT_DRAFT_MAX
    first: int = 4  # a proposer's first round
    costs: dict[str, float] = field(default_factory=dict)
    decay: float = 0.8
    prior: float = 0.7
    prior_weight: float = 2.0
    verify_cost: float = VERIFY_COST
    _est: dict[str, _Estimate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(f"need 0 <= draft_min <= draft_max, got {self.draft_min} and {self.draft_max}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def cost(self, source: str) -> float:
        return self.costs.get(source.split("/")[0], 0.0) + self.verify_cost

    def acceptance(self, source: str) -> float:
        e = self._est.get(source)
        return e.a if e is not None else self.prior

    def k(self, source: str) -> int:
        e = self._est.get(source)
        if e is None or e.rounds == 0:
            return min(max(self.first, self.draft_min), self.draft_max)
        return best_length(e.a, self.cost(source), self.draft_min, self.draft_max)

    def update(self, source: str, k: int, n: int) -> None:
        """Record a round of `source` that drafted k tokens and had n of them accepted."""
        if k <= 0:
            return
        e = self._est.setdefault(source, _Estimate(self.prior * self.prior_weight, self.prior_weight))
        e.successes = self.decay * e.successes + n
        e.tests = self.decay * e.tests + n + (1 if n < k else 0)
        e.rounds += 1


def weight_ratio(draft, target) -> float:
    """Bytes of the draft's weights over the target's: the cost of a draft step relative to a
    target step when decoding is memory-bound (one token at a time reads every weight once)."""
    from mlx.utils import tree_flatten

    def nbytes(model) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    t = nbytes(target)
    return nbytes(draft) / t if t else 0.0
