"""`mlxspec bench`: is speculation faster for this pair on this machine, and with which settings?

The benchmark runs a prompt suite with the target alone and with speculation for a sweep of
draft lengths k, and puts what it achieved beside what the measured costs predict:

    E[tokens per round](k) = 1 + sum_{i<=k} s_i      s_i: how often draft position i was accepted
    cost of a round(k)     = k * c + v(k + 1)        in units of one target one-token step
    predicted speedup(k)   = E[tokens per round](k) / cost of a round(k)

with c = (draft one-token step) / (target one-token step) and v(n) = (target forward over n
tokens) / (target forward over 1 token), both timed on the loaded models with a KV cache.
When achieved is well below predicted, the implementation is the limit; when predicted is below
1.0, the pair (or the hardware) is.

Timing: a warm-up of every configuration first; then, for each repeat (and seed), each prompt
runs every configuration in turn (order reversed on every other block, so slow drift cancels);
tokens/s is generated tokens over decode time (prefill excluded, time to first token reported
apart). Speedups are ratios within the same repeat; medians and min/max over repeats are shown.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import click

from .cli_options import generation_options
from .errors import MlxspecError
from .options import GenerateOptions

DEFAULT_DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)
BUILTIN_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
KINDS = ("code", "edit", "chat", "summarize")


class PromptFileError(MlxspecError, ValueError):
    """A prompt file that cannot be read as a suite."""


# ---------------------------------------------------------------------------------------------
# The arithmetic (pure functions, unit-tested on known numbers)
# ---------------------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of an empty sequence")
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else (s[m - 1] + s[m]) / 2.0


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of an empty sequence")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(xs: Sequence[float]) -> dict:
    """Median, quartiles and range of repeated measurements."""
    xs = [float(x) for x in xs]
    return {
        "median": median(xs),
        "q1": quantile(xs, 0.25),
        "q3": quantile(xs, 0.75),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def survival(accepted_per_position: Sequence[int], drafted_per_position: Sequence[int]) -> list[float]:
    """s_i: the fraction of rounds that drafted position i in which it was accepted (which
    needs every position before it accepted too)."""
    return [a / d if d else 0.0 for a, d in zip(accepted_per_position, drafted_per_position)]


def conditional_acceptance(accepted_per_position: Sequence[int], drafted_per_position: Sequence[int]) -> list[float]:
    """P(position i accepted | positions before it accepted). The rounds that reached position
    i are those that drafted it with i-1 accepted (approximated by the smaller count, exact
    whenever every round drafted the same k)."""
    out = []
    for i, (a, d) in enumerate(zip(accepted_per_position, drafted_per_position)):
        reached = d if i == 0 else min(d, accepted_per_position[i - 1])
        out.append(a / reached if reached else 0.0)
    return out


def iid_alpha(accepted_per_position: Sequence[int], drafted_per_position: Sequence[int]) -> float:
    """Acceptance probability of one draft token in the i.i.d. model: accepted tokens over the
    draft tokens that were actually judged (those after a rejection are not)."""
    judged = 0
    for i, d in enumerate(drafted_per_position):
        judged += d if i == 0 else min(d, accepted_per_position[i - 1])
    return sum(accepted_per_position) / judged if judged else 0.0


def expected_tokens_iid(alpha: float, k: int) -> float:
    """E[tokens per round] with k drafts each accepted with probability alpha (Leviathan et al.):
    (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens(surv: Sequence[float], k: int) -> float:
    """E[tokens per round] = 1 (the target's own token) + sum of P(position i accepted), i <= k."""
    return 1.0 + sum(surv[:k])


def round_cost(k: int, c: float, v: Sequence[float]) -> float:
    """Cost of one round in target one-token steps: k draft steps and one target forward over
    k+1 tokens. v[n-1] is v(n)."""
    if k + 1 > len(v):
        raise ValueError(f"the verify cost curve covers up to {len(v)} tokens, k + 1 = {k + 1}")
    return k * c + v[k]


def predicted_speedup(tokens_per_round: float, k: int, c: float, v: Sequence[float]) -> float:
    return tokens_per_round / round_cost(k, c, v)


def recommend(speedups: dict[int, float], predicted: dict[int, float] | None = None) -> dict:
    """The best draft length by median speedup, or None when nothing beats 1.0x."""
    if not speedups:
        return {"num_draft": None, "speedup": None, "text": "no speculative setting was measured"}
    best = max(speedups, key=lambda k: (speedups[k], -k))
    s = speedups[best]
    if s <= 1.0:
        text = f"speculation does not pay here: the best setting (k={best}) reached {s:.2f}x"
        if predicted:
            pbest = max(predicted, key=lambda k: predicted[k])
            text += f" (the measured costs predict at most {predicted[pbest]:.2f}x, at k={pbest})"
        return {"num_draft": None, "speedup": s, "text": text}
    text = f"use a draft length of {best}: {s:.2f}x over the target alone"
    if predicted and best in predicted:
        text += f" (predicted {predicted[best]:.2f}x)"
    return {"num_draft": best, "speedup": s, "text": text}


# ---------------------------------------------------------------------------------------------
# The prompt suite
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    kind: str
    prompt: str | None = None  # sent as one user message when the tokenizer has a chat template
    messages: tuple | None = None
    raw: bool = False  # send `prompt` as plain text even when there is a chat template

    def input(self, tokenizer) -> str | list[dict]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        if not self.raw and getattr(tokenizer, "chat_template", None):
            return [{"role": "user", "content": self.prompt}]
        return self.prompt


def load_prompts(path: str | Path | None = None, kinds: Sequence[str] | None = None, per_kind: int | None = None) -> list[BenchPrompt]:
    """Read a JSONL suite: one object a line with "prompt" (text) or "messages" (chat), and
    optional "id", "kind" and "raw". Blank lines are skipped. kinds: keep only these;
    per_kind: keep the first N prompts of each kind."""
    path = Path(path) if path is not None else BUILTIN_PROMPTS
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise PromptFileError(f"cannot read the prompt file {path}: {e.strerror or e}") from e
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object with a \"prompt\" or \"messages\" field")
        text, messages = obj.get("prompt"), obj.get("messages")
        if (text is None) == (messages is None):
            raise PromptFileError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" (a chat)")
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise PromptFileError(f"{where}: \"prompt\" must be a non-empty string")
        if messages is not None:
            ok = isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
            if not ok:
                raise PromptFileError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
            messages = tuple(tuple(sorted(m.items())) for m in messages)
        prompts.append(
            BenchPrompt(
                id=str(obj.get("id", f"line{n}")),
                kind=str(obj.get("kind", "other")),
                prompt=text,
                messages=messages,
                raw=bool(obj.get("raw", False)),
            )
        )
    if not prompts:
        raise PromptFileError(f"the prompt file {path} has no prompts (one JSON object a line)")
    if kinds:
        wanted = set(kinds)
        prompts = [p for p in prompts if p.kind in wanted]
        if not prompts:
            raise PromptFileError(f"no prompt in {path} has a kind among {', '.join(kinds)}")
    if per_kind is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.kind] = seen.get(p.kind, 0) + 1
            if seen[p.kind] <= per_kind:
                kept.append(p)
        prompts = kept
    return prompts


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    draft_lengths: tuple[int, ...] = DEFAULT_DRAFT_LENGTHS
    max_tokens: int = 128
    repeats: int = 3
    temperature: float = 0.0
    seeds: int = 1  # sampled runs: each repeat goes over this many seeds
    compare_mlx_lm: bool = False
    warmup: bool = True
    cost_repeats: int = 5
    # how mlxspec drafts in its speculative settings (drafter, adaptive, ...); the sweep sets
    # num_draft, max_tokens, temperature and seed
    drafting: GenerateOptions = GenerateOptions()

    @property
    def drafting_settings(self) -> dict:
        """The drafting options, for the report."""
        d = self.drafting
        return dict(drafter=d.drafter, adaptive=d.adaptive, draft_min=d.draft_min, draft_max=d.draft_max,
                    draft_p_min=d.draft_p_min, ngram_min=d.ngram_min, ngram_max=d.ngram_max,
                    draft_vocab=d.draft_vocab)

    def __post_init__(self) -> None:
        if not self.draft_lengths or any(k < 1 for k in self.draft_lengths):
            raise ValueError("draft lengths must be integers >= 1")
        if self.max_tokens < 1 or self.repeats < 1 or self.seeds < 1 or self.cost_repeats < 1:
            raise ValueError("max_tokens, repeats, seeds and cost_repeats must be >= 1")

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds if self.temperature > 0 else 1))


@dataclass(frozen=True)
class Setting:
    """One configuration of the sweep. num_draft = 0: the target alone."""

    engine: str  # "mlxspec" or "mlx-lm"
    num_draft: int

    @property
    def label(self) -> str:
        return f"{self.engine} k={self.num_draft}" if self.num_draft else f"{self.engine} target alone"


@dataclass
class Run:
    engine: str
    num_draft: int
    prompt_id: str
    kind: str
    repeat: int
    seed: int
    prompt_tokens: int
    tokens: int
    prefill_time: float
    decode_time: float
    ttft: float
    rounds: int
    drafted: int
    accepted: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    peak_memory: int
    identical_to_target: bool | None = None
    output: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_time if self.decode_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("output")
        d["tokens_per_second"] = self.tokens_per_second
        return d


def run_mlxspec(pair, ids: list[int], k: int, max_tokens: int, temperature: float, seed: int,
                drafting: GenerateOptions = GenerateOptions()) -> Run:
    """One generation through mlxspec's engine (k = 0: plain pipelined decoding)."""
    ttft = None
    out: list[int] = []
    stats = None
    opts = drafting.replace(max_tokens=max_tokens, temperature=temperature, num_draft=k, seed=seed)
    if k == 0:
        opts = opts.replace(drafter="none", adaptive=False)
    for chunk in pair.stream(ids, opts):
        if ttft is None:
            ttft = chunk.stats.prefill_time + chunk.stats.decode_time
        out += chunk.tokens
        stats = chunk.stats
    return Run(
        engine="mlxspec", num_draft=k, prompt_id="", kind="", repeat=0, seed=seed,
        prompt_tokens=len(ids), tokens=stats.generation_tokens, prefill_time=stats.prefill_time,
        decode_time=stats.decode_time, ttft=ttft or 0.0, rounds=stats.rounds, drafted=stats.drafted,
        accepted=stats.accepted, accepted_per_position=list(stats.accepted_per_position),
        drafted_per_position=list(stats.drafted_per_position), peak_memory=stats.peak_memory, output=out,
    )


def _prefill(model, ids: list[int], step: int = 512):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    todo = ids[:-1]
    for i in range(0, len(todo), step):
        model(mx.array(todo[i : i + step], mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def run_mlx_lm(pair, ids: list[int], k: int, max_tokens: int, temperature: float, seed: int) -> Run:
    """One generation through mlx-lm's own `stream_generate` (with `draft_model` when k > 0),
    on the same model objects and prompt tokens. The prompt is prefilled here into caches that
    are handed to mlx-lm, so prefill and decode are timed apart exactly as for mlxspec."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    cache = _prefill(pair.target, ids)
    kwargs = dict(max_tokens=max_tokens, sampler=make_sampler(temp=temperature))
    if k > 0:
        kwargs.update(draft_model=pair.draft, num_draft_tokens=k, prompt_cache=cache + _prefill(pair.draft, ids))
    else:
        kwargs.update(prompt_cache=cache)
    prefill_time = time.perf_counter() - tic
    detok = getattr(pair.tokenizer, "detokenizer", None)
    if detok is not None:
        detok.reset()
    out, flags = [], []
    first = None
    last = None
    tic = time.perf_counter()
    for resp in stream_generate(pair.target, pair.tokenizer, mx.array(ids[-1:], mx.uint32), **kwargs):
        if first is None:
            first = time.perf_counter() - tic
        out.append(resp.token)
        flags.append(resp.from_draft)
        last = resp
    decode_time = time.perf_counter() - tic
    # rounds: each target pass emits its own token last, so count the tokens not from the draft
    rounds = sum(1 for f in flags if not f)
    if last is not None and last.finish_reason == "stop":  # mlx-lm reports the stop token too
        out, flags = out[:-1], flags[:-1]
    accepted = sum(flags)
    return Run(
        engine="mlx-lm", num_draft=k, prompt_id="", kind="", repeat=0, seed=seed,
        prompt_tokens=len(ids), tokens=len(out), prefill_time=prefill_time, decode_time=decode_time,
        ttft=prefill_time + (first or 0.0), rounds=rounds, drafted=0, accepted=accepted,
        accepted_per_position=[], drafted_per_position=[], peak_memory=mx.get_peak_memory(), output=out,
    )


RUNNERS: dict[str, Callable[..., Run]] = {"mlxspec": run_mlxspec, "mlx-lm": run_mlx_lm}


@dataclass
class Costs:
    context_tokens: int
    target_step: float  # seconds, one target forward over 1 token (median)
    draft_step: float  # seconds, one draft forward over 1 token (median)
    verify: list[float]  # seconds, target forward over n = 1..N tokens (medians)

    @property
    def c(self) -> float:
        return self.draft_step / self.target_step

    @property
    def v(self) -> list[float]:
        return [t / self.target_step for t in self.verify]

    def to_dict(self) -> dict:
        return {
            "context_tokens": self.context_tokens,
            "target_step_s": self.target_step,
            "draft_step_s": self.draft_step,
            "verify_s": self.verify,
            "c": self.c,
            "v": self.v,
        }


def measure_costs(pair, ids: list[int], max_n: int, repeats: int = 5, draft_vocab: int = 0) -> Costs:
    """Time target forwards over n = 1..max_n tokens and a one-token draft forward, each after
    the prompt `ids` is in the KV cache (trimmed back after every forward), interleaved over
    repeats after one warm-up pass; medians. draft_vocab: the draft's output layer cut to that
    many ids, as drafter option `draft_vocab` does."""
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    tcache = _prefill(pair.target, ids)
    feed = (list(ids) * (max_n // len(ids) + 1))[:max_n]
    if pair.draft is None and getattr(pair, "head", None) is not None:  # a trained head's draft step
        draft, dcache = pair.head.step_timer(pair.head, pair.target, len(ids))
    else:
        dcache = _prefill(pair.draft, ids)
        draft = pair.draft
    if draft_vocab and pair.draft is not None:
        from .drafters.model import ReducedHead, draft_vocab_ids

        head = ReducedHead(pair.draft, draft_vocab_ids(draft_vocab, pair.vocab_size, pair.eos_token_ids))
        draft = lambda x, cache: head(head.hidden(x[0], cache)[-1:])  # noqa: E731

    def timed(model, cache, n: int) -> float:
        x = mx.array(feed[:n], mx.uint32)[None]
        mx.eval(x)
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        dt = time.perf_counter() - t0
        trim_prompt_cache(cache, n)
        return dt

    tt: dict[int, list[float]] = {n: [] for n in range(1, max_n + 1)}
    td: list[float] = []
    for rep in range(repeats + 1):
        for n in range(1, max_n + 1):
            t = timed(pair.target, tcache, n)
            if rep:
                tt[n].append(t)
        t = timed(draft, dcache, 1)
        if rep:
            td.append(t)
    verify = [median(tt[n]) for n in range(1, max_n + 1)]
    # a block head (DFlash, DSpark) drafts a whole block per timed step: c per drafted token
    per_step = pair.head.info.get("drafts_per_step", 1) if pair.draft is None and getattr(pair, "head", None) else 1
    return Costs(context_tokens=len(ids), target_step=verify[0], draft_step=median(td) / per_step, verify=verify)


# ---------------------------------------------------------------------------------------------
# The sweep and its summary
# ---------------------------------------------------------------------------------------------


def sweep_settings(cfg: BenchConfig) -> list[Setting]:
    """Target alone, then each draft length; with mlx-lm, its setting right after ours (A B A B)."""
    engines = ["mlxspec", "mlx-lm"] if cfg.compare_mlx_lm else ["mlxspec"]
    return [Setting(e, k) for k in (0, *cfg.draft_lengths) for e in engines]


def run_bench(pair, prompts: Sequence[BenchPrompt], cfg: BenchConfig, log: Callable[[str], None] | None = None) -> dict:
    """Run the sweep on a loaded Pair (with a draft) and return the report (see `summarize_runs`)."""
    from . import __version__
    from .platform import machine_description

    head = getattr(pair, "head", None)
    if pair.draft is None and head is None:
        raise MlxspecError("bench needs a draft model: pass --draft, or a pair folder as --target")
    if pair.draft is None and cfg.compare_mlx_lm:
        raise MlxspecError(f"--compare-mlx-lm needs a draft model: mlx-lm cannot draft with a trained {head.family} head")
    if pair.draft is None and head.step_timer is None:
        raise MlxspecError(f"bench cannot time a {head.family} head's draft step yet")
    log = log or (lambda s: None)
    encoded = [(p, pair.encode(p.input(pair.tokenizer))) for p in prompts]
    settings = sweep_settings(cfg)
    seeds = cfg.seed_list
    runners = dict(RUNNERS, mlxspec=lambda *a: run_mlxspec(*a, cfg.drafting))

    load_start = _load_average()
    if cfg.warmup:  # long enough for every setting to run full rounds
        log("warm-up: every setting once on the first prompt")
        ids = encoded[0][1]
        for s in settings:
            runners[s.engine](pair, ids, s.num_draft, min(cfg.max_tokens, max(cfg.draft_lengths) + 2), cfg.temperature, 0)

    ctx = sorted(encoded, key=lambda e: len(e[1]))[len(encoded) // 2][1]  # a prompt of median length
    log(f"costs: target forwards over 1..{max(cfg.draft_lengths) + 1} tokens and a draft step, {cfg.cost_repeats} repeats")
    costs = measure_costs(pair, ctx, max(cfg.draft_lengths) + 1, cfg.cost_repeats, cfg.drafting.draft_vocab)
    log(f"  target step {costs.target_step * 1e3:.1f} ms, draft step {costs.draft_step * 1e3:.1f} ms, c = {costs.c:.3f}")

    runs: list[Run] = []
    total = cfg.repeats * len(seeds) * len(encoded) * len(settings)
    block = 0
    for rep in range(cfg.repeats):
        for seed in seeds:
            for p, ids in encoded:
                order = settings if block % 2 == 0 else settings[::-1]
                block += 1
                done: dict[Setting, Run] = {}
                for s in order:
                    r = runners[s.engine](pair, ids, s.num_draft, cfg.max_tokens, cfg.temperature, seed)
                    r.prompt_id, r.kind, r.repeat = p.id, p.kind, rep
                    done[s] = r
                    runs.append(r)
                    log(f"[{len(runs)}/{total}] repeat {rep + 1} {p.id:<16} {s.label:<24} "
                        f"{r.tokens:4d} tokens {r.tokens_per_second:7.2f} tok/s")
                if cfg.temperature == 0:  # greedy: speculation must not change the text
                    for s, r in done.items():
                        base = done[Setting(s.engine, 0)]
                        r.identical_to_target = r.output == base.output
    report = summarize_runs(runs, costs, cfg)
    report["mlxspec_version"] = __version__
    report["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report["machine"] = machine_description()
    report["prompts"] = [{"id": p.id, "kind": p.kind, "prompt_tokens": len(ids)} for p, ids in encoded]
    # other work on the machine makes timings drift: say how busy it was
    report["conditions"] = {"load_average_start": load_start, "load_average_end": _load_average()}
    return report


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _pooled_tps(runs: Sequence[Run]) -> float:
    t = sum(r.decode_time for r in runs)
    return sum(r.tokens for r in runs) / t if t > 0 else 0.0


def summarize_runs(runs: Sequence[Run], costs: Costs, cfg: BenchConfig) -> dict:
    """Every number of the report. For each setting:
    - tokens_per_second: suite tokens over suite decode time, per repeat (and seed);
    - speedup: that over the same engine's target alone in the same repeat (and seed);
      for mlx-lm also over mlxspec's target alone (speedup_vs_mlxspec_target);
    - per_prompt_speedup: the ratio per prompt and repeat (prompts differ in acceptance);
    - acceptance pooled over all its runs; predicted speedups from the measured costs."""
    groups = sorted({(r.repeat, r.seed) for r in runs})
    by = {}
    for r in runs:
        by.setdefault((r.engine, r.num_draft), []).append(r)

    def per_group(engine: str, k: int) -> dict:
        return {g: _pooled_tps([r for r in by[(engine, k)] if (r.repeat, r.seed) == g]) for g in groups}

    results = []
    for (engine, k), rs in sorted(by.items(), key=lambda e: (e[0][0] != "mlxspec", e[0][1])):
        tps = per_group(engine, k)
        base = per_group(engine, 0)
        entry = {
            "engine": engine,
            "num_draft": k,
            "tokens": sum(r.tokens for r in rs),
            "tokens_per_second": summarize(list(tps.values())),
            "speedup": summarize([tps[g] / base[g] for g in groups if base[g] > 0]),
            "per_prompt_speedup": summarize(_per_prompt_ratios(rs, by[(engine, 0)])),
            "ttft_s": summarize([r.ttft for r in rs]),
            "peak_memory_bytes": max(r.peak_memory for r in rs),
            "rounds": sum(r.rounds for r in rs),
            # each target pass emits its accepted drafts and one token of its own
            "tokens_per_pass": 1.0 + sum(r.accepted for r in rs) / max(1, sum(r.rounds for r in rs)),
        }
        if engine != "mlxspec" and ("mlxspec", 0) in by:
            ours = per_group("mlxspec", 0)
            entry["speedup_vs_mlxspec_target"] = summarize([tps[g] / ours[g] for g in groups if ours[g] > 0])
        checked = [r.identical_to_target for r in rs if r.identical_to_target is not None]
        if checked:
            entry["identical_to_target"] = sum(checked) / len(checked)
        if k > 0:
            entry["accepted"] = sum(r.accepted for r in rs)
            entry["acceptance_rate_from_draft"] = entry["accepted"] / max(1, entry["tokens"])
            if engine == "mlxspec":
                entry.update(_acceptance_and_prediction(rs, k, costs))
        results.append(entry)

    ours = {e["num_draft"]: e for e in results if e["engine"] == "mlxspec"}
    rec = recommend(
        {k: e["speedup"]["median"] for k, e in ours.items() if k > 0},
        {k: e["predicted_speedup"] for k, e in ours.items() if k > 0},
    )
    return {
        "settings": {
            "draft_lengths": list(cfg.draft_lengths),
            "max_tokens": cfg.max_tokens,
            "repeats": cfg.repeats,
            "temperature": cfg.temperature,
            "seeds": cfg.seed_list,
            "compare_mlx_lm": cfg.compare_mlx_lm,
            "warmup": cfg.warmup,
            "cost_repeats": cfg.cost_repeats,
            **cfg.drafting_settings,
        },
        "costs": costs.to_dict(),
        "results": results,
        "recommendation": rec,
        "runs": [r.to_dict() for r in runs],
    }


def _per_prompt_ratios(rs: Sequence[Run], base: Sequence[Run]) -> list[float]:
    b = {(r.prompt_id, r.repeat, r.seed): r.tokens_per_second for r in base}
    return [
        r.tokens_per_second / b[key]
        for r in rs
        if (key := (r.prompt_id, r.repeat, r.seed)) in b and b[key] > 0
    ]


def _acceptance_and_prediction(rs: Sequence[Run], k: int, costs: Costs) -> dict:
    width = max([k] + [len(r.drafted_per_position) for r in rs])  # adaptive length may draft past k
    acc = [0] * width
    dr = [0] * width
    for r in rs:
        for i, (a, d) in enumerate(zip(r.accepted_per_position, r.drafted_per_position)):
            acc[i] += a
            dr[i] += d
    drafted = sum(r.drafted for r in rs)
    accepted = sum(r.accepted for r in rs)
    surv = survival(acc, dr)
    alpha = iid_alpha(acc, dr)
    e_tokens = expected_tokens(surv, k)
    passes = sum(r.rounds for r in rs)
    measured_tpp = 1.0 + accepted / passes if passes else 0.0
    pred = predicted_speedup(e_tokens, k, costs.c, costs.v)
    return {
        "drafted": drafted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "position_acceptance": surv,
        "conditional_position_acceptance": conditional_acceptance(acc, dr),
        "alpha_iid": alpha,
        "expected_tokens_per_round": e_tokens,
        "round_cost": round_cost(k, costs.c, costs.v),
        "predicted_speedup": pred,
        "predicted_speedup_iid": predicted_speedup(expected_tokens_iid(alpha, k), k, costs.c, costs.v),
        "predicted_speedup_from_tokens_per_pass": predicted_speedup(measured_tpp, k, costs.c, costs.v),
    }


# ---------------------------------------------------------------------------------------------
# Output: table, JSON, plot
# ---------------------------------------------------------------------------------------------


def _gib(b) -> str:
    try:
        return f"{int(b) / 2**30:.1f} GiB"
    except (TypeError, ValueError):
        return "?"


def describe_machine(m: dict) -> str:
    parts = [m.get("os", "?"), m.get("chip", m.get("machine", "?"))]
    if m.get("cpu_count"):
        parts.append(f"{m['cpu_count']} cores")
    if m.get("memory_bytes"):
        parts.append(_gib(m["memory_bytes"]))
    parts.append(f"MLX {m.get('mlx_version', '?')} on {m.get('mlx_device', '?')}")
    if m.get("blas"):
        parts.append(f"BLAS: {m['blas']}")
    return ", ".join(parts)


def _short(path) -> str:
    """The last two parts of a model path (a pair folder's target is <pair>/target)."""
    return "/".join(Path(str(path)).parts[-2:])


def format_report(report: dict) -> str:
    st, costs = report["settings"], report["costs"]
    lines = []
    models = report.get("models", {})
    if models:
        lines.append(f"target {models.get('target')}  draft {models.get('draft')}  dtype {models.get('dtype')}")
    mode = "greedy" if st["temperature"] == 0 else f"temperature {st['temperature']}, seeds {st['seeds']}"
    lines.append(
        f"{len(report.get('prompts', []))} prompts, {st['max_tokens']} tokens each, {mode}, "
        f"{st['repeats']} repeats"
    )
    if "machine" in report:
        lines.append("machine: " + describe_machine(report["machine"]))
        if report["machine"].get("blas_fix"):
            lines.append("  MLX uses the slow reference BLAS; speculation cannot pay on it. Fix: " + report["machine"]["blas_fix"])
    lines.append(
        f"costs: target step {costs['target_step_s'] * 1e3:.1f} ms, draft step {costs['draft_step_s'] * 1e3:.1f} ms, "
        f"c = {costs['c']:.3f}; verify cost v(n), n = 1..{len(costs['v'])}: " + " ".join(f"{x:.2f}" for x in costs["v"])
    )
    lines.append("")
    head = f"{'engine':<8} {'k':>2} {'tok/s':>7} {'speedup [min-max]':>19} {'accept':>6} {'tok/pass':>8} {'predicted':>9} {'ach/pred':>8} {'TTFT s':>7} {'peak':>9}"
    lines.append(head)
    lines.append("-" * len(head))
    for e in report["results"]:
        sp = e["speedup"]
        spd = f"{sp['median']:.2f}x [{sp['min']:.2f}-{sp['max']:.2f}]"
        acc = f"{e['acceptance_rate']:.2f}" if "acceptance_rate" in e else ("-" if e["num_draft"] == 0 else f"~{e['acceptance_rate_from_draft']:.2f}")
        pred = e.get("predicted_speedup")
        pred_s = f"{pred:.2f}x" if pred else "-"
        ratio_s = f"{sp['median'] / pred:.2f}" if pred else "-"
        lines.append(
            f"{e['engine']:<8} {e['num_draft']:>2} {e['tokens_per_second']['median']:>7.2f} {spd:>19} {acc:>6} "
            f"{e['tokens_per_pass']:>8.2f} {pred_s:>9} "
            f"{ratio_s:>8} {e['ttft_s']['median']:>7.2f} {_gib(e['peak_memory_bytes']):>9}"
        )
    lines.append("")
    lines.append("k = 0: the target alone. speedup: over the same engine's target alone, median over repeats.")
    if any(e["engine"] == "mlx-lm" for e in report["results"]):
        lines.append("mlx-lm 'accept' (~): share of its output that came from the draft.")
    pos = [e for e in report["results"] if e.get("position_acceptance")]
    if pos:
        lines.append("per-position acceptance (how often draft position i was accepted):")
        for e in pos:
            lines.append(f"  k={e['num_draft']}: " + " ".join(f"{x:.2f}" for x in e["position_acceptance"]))
    ident = [e for e in report["results"] if e["num_draft"] > 0 and "identical_to_target" in e]
    if ident and any(e["identical_to_target"] < 1 for e in ident):
        lines.append("output identical to the target alone: " + ", ".join(
            f"{e['engine']} k={e['num_draft']}: {e['identical_to_target']:.0%}" for e in ident))
    lines.append("")
    lines.append("recommendation: " + report["recommendation"]["text"])
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    """The short results table, for a README or an issue."""
    st, costs, m = report["settings"], report["costs"], report.get("machine", {})
    models = report.get("models", {})
    mode = "greedy" if st["temperature"] == 0 else f"temperature {st['temperature']}, seeds {st['seeds']}"
    theirs = {e["num_draft"]: e for e in report["results"] if e["engine"] == "mlx-lm"}
    out = [
        f"Target `{models.get('target')}`, draft `{models.get('draft')}`, {models.get('dtype')}; "
        f"{len(report.get('prompts', []))} prompts ({', '.join(sorted({p['kind'] for p in report.get('prompts', [])}))}), "
        f"{st['max_tokens']} tokens each, {mode}, {st['repeats']} repeats.  ",
        f"Machine: {describe_machine(m)}.  ",
        f"Costs: target step {costs['target_step_s'] * 1e3:.0f} ms, draft step {costs['draft_step_s'] * 1e3:.0f} ms "
        f"(c = {costs['c']:.3f}); verify cost v(n) for n = 1..{len(costs['v'])}: "
        + ", ".join(f"{x:.2f}" for x in costs["v"]) + ".",
        "",
        "| k | tokens/s | speedup, median [min-max] | acceptance | tokens/pass | predicted | achieved/predicted"
        + (" | mlx-lm tokens/s | mlx-lm speedup |" if theirs else " |"),
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if theirs else ""),
    ]
    for e in (e for e in report["results"] if e["engine"] == "mlxspec"):
        k, sp = e["num_draft"], e["speedup"]
        pred = e.get("predicted_speedup")
        row = (
            f"| {k if k else '0 (target alone)'} | {e['tokens_per_second']['median']:.2f} | "
            f"{sp['median']:.2f}x [{sp['min']:.2f}-{sp['max']:.2f}] | "
            f"{e['acceptance_rate']:.2f} | " if k else
            f"| 0 (target alone) | {e['tokens_per_second']['median']:.2f} | 1.00x | - | "
        )
        row += f"{e['tokens_per_pass']:.2f} | " + (f"{pred:.2f}x | {sp['median'] / pred:.2f} |" if pred else "- | - |")
        if theirs:
            t = theirs.get(k)
            row += (f" {t['tokens_per_second']['median']:.2f} | {t['speedup']['median']:.2f}x |" if t else " - | - |")
        out.append(row)
    base = next((e for e in report["results"] if e["engine"] == "mlxspec" and e["num_draft"] == 0), None)
    if base is not None:
        best = report["recommendation"].get("num_draft")
        be = next((e for e in report["results"] if e["engine"] == "mlxspec" and e["num_draft"] == best), None)
        line = f"Time to first token: {base['ttft_s']['median']:.2f} s alone"
        if be is not None:
            line += f", {be['ttft_s']['median']:.2f} s at k={best}"
        line += f"; peak memory {_gib(base['peak_memory_bytes'])} alone"
        if be is not None:
            line += f", {_gib(be['peak_memory_bytes'])} at k={best}"
        out += ["", line + "."]
    out += ["", f"Recommendation: {report['recommendation']['text']}."]
    return "\n".join(out) + "\n"


def write_plot(report: dict, path: str | Path) -> None:
    """Speedup (achieved with its range, and predicted) and acceptance against draft length, and
    the verify cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [e for e in report["results"] if e["engine"] == "mlxspec" and e["num_draft"] > 0]
    theirs = [e for e in report["results"] if e["engine"] == "mlx-lm" and e["num_draft"] > 0]
    ks = [e["num_draft"] for e in ours]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))

    ax = axes[0]
    med = [e["speedup"]["median"] for e in ours]
    lo = [m - e["speedup"]["min"] for m, e in zip(med, ours)]
    hi = [e["speedup"]["max"] - m for m, e in zip(med, ours)]
    ax.errorbar(ks, med, yerr=[lo, hi], marker="o", capsize=4, label="mlxspec, achieved (min-max)")
    ax.plot(ks, [e["predicted_speedup"] for e in ours], "s--", label="predicted from c, v and acceptance")
    if theirs:
        tk = [e["num_draft"] for e in theirs]
        tm = [e["speedup"]["median"] for e in theirs]
        tlo = [m - e["speedup"]["min"] for m, e in zip(tm, theirs)]
        thi = [e["speedup"]["max"] - m for m, e in zip(tm, theirs)]
        ax.errorbar(tk, tm, yerr=[tlo, thi], marker="^", capsize=4, color="gray", label="mlx-lm speculative, achieved")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over the target alone")
    ax.set_title("Speedup")
    ax.set_xticks(ks)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1]
    ax.plot(ks, [e["acceptance_rate"] for e in ours], "o-", label="acceptance rate")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("acceptance rate", color="C0")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(ks)
    ax2 = ax.twinx()
    ax2.plot(ks, [e["tokens_per_pass"] for e in ours], "s-", color="C2", label="tokens per target pass")
    ax2.plot(ks, [k + 1 for k in ks], ":", color="C2", alpha=0.5, label="k + 1 (all accepted)")
    ax2.set_ylabel("tokens per target pass", color="C2")
    ax2.set_ylim(0, max(ks) + 1.5)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower left")
    ax.set_title("Acceptance")
    ax.grid(alpha=0.3)

    ax = axes[2]
    c = report["costs"]
    n = list(range(1, len(c["v"]) + 1))
    ax.plot(n, c["v"], "o-", label="v(n): target forward over n tokens")
    ax.plot(n, n, ":", color="gray", label="n (no batching gain)")
    ax.axhline(c["c"], color="C1", ls="--", label=f"c = draft step / target step = {c['c']:.2f}")
    ax.set_xlabel("tokens in one target forward (k + 1)")
    ax.set_ylabel("time relative to one token")
    ax.set_title("Costs")
    ax.set_xticks(n)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    m = report.get("machine", {})
    models = report.get("models", {})
    title = f"{_short(models.get('target', 'target'))} + {_short(models.get('draft', 'draft'))}"
    st = report["settings"]
    mode = "greedy" if st["temperature"] == 0 else f"T={st['temperature']}"
    fig.suptitle(f"mlxspec bench: {title}, {models.get('dtype', '')}, {mode}, {st['max_tokens']} tokens\n"
                 f"{describe_machine(m)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(x) for x in value.split(",") if x.strip()}))
    except ValueError:
        raise click.BadParameter(f"expected a comma-separated list of integers, got {value!r}")
    if not ks or ks[0] < 1:
        raise click.BadParameter("draft lengths must be integers >= 1")
    return ks


def _kinds(ctx, param, value: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in value.split(",") if x.strip()) if value else None


def resolve_dtype(dtype: str) -> str | None:
    """auto: float32 on a CPU (half precision is much slower there), as stored on a GPU."""
    if dtype != "auto":
        return dtype
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else None


# The options, kept as a list so that new ones (drafters, adaptive length) are one line each.
BENCH_OPTIONS = [
    click.option("--target", "-t", required=True, help="Target model folder, pair folder or hub repo id."),
    click.option("--draft", "-d", default=None, help="Draft model (optional when --target is a pair folder)."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
                 show_default=True, help="Weights dtype; auto = float32 on a CPU, as stored on a GPU."),
    click.option("--num-draft", "-k", "draft_lengths", default=",".join(map(str, DEFAULT_DRAFT_LENGTHS)),
                 show_default=True, callback=_int_list, help="Draft lengths to sweep (comma-separated)."),
    click.option("--max-tokens", "-m", default=128, show_default=True, type=click.IntRange(1), help="Tokens per prompt."),
    click.option("--repeats", "-r", default=3, show_default=True, type=click.IntRange(1), help="Repeats of the whole suite."),
    click.option("--prompts", "prompt_file", type=click.Path(dir_okay=False), default=None,
                 help="Your own suite: JSONL, one {\"prompt\": ...} or {\"messages\": [...]} a line "
                      "(optional \"id\", \"kind\", \"raw\"). Default: the built-in suite."),
    click.option("--kinds", callback=_kinds, default=None,
                 help=f"Only prompts of these kinds (comma-separated; built-in: {', '.join(KINDS)})."),
    click.option("--per-kind", type=click.IntRange(1), default=None, help="Only the first N prompts of each kind."),
    click.option("--temperature", "--temp", default=0.0, show_default=True, type=click.FloatRange(0.0),
                 help="0 is greedy; above 0 every repeat runs each seed."),
    click.option("--seeds", default=3, show_default=True, type=click.IntRange(1), help="Seeds per repeat for sampled runs."),
    click.option("--compare-mlx-lm", is_flag=True, help="Also run mlx-lm's own generation, alternating with ours."),
    click.option("--warmup/--no-warmup", default=True, show_default=True, help="Run every setting once before timing."),
    click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write every number here."),
    click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Write a PNG plot here."),
    click.option("--markdown", "md_out", type=click.Path(dir_okay=False), default=None,
                 help="Write the short results table here (Markdown)."),
    click.option("--acceptance", default=None,
                 help="Synthetic targets (-t synthetic:SHAPE): the acceptance to predict with, an earlier "
                      "`mlxspec bench --json` report or a per-token rate (default 0.8)."),
    click.option("--context", type=click.IntRange(1), default=128, show_default=True,
                 help="Synthetic targets: tokens in the KV cache while timing."),
    click.option("--quiet", "-q", is_flag=True, help="No progress lines."),
]


def _with_options(f):
    for opt in reversed(BENCH_OPTIONS):
        f = opt(f)
    return f


def _synthetic_bench(target, draft, dtype, draft_lengths, acceptance, context, json_out, quiet) -> None:
    from .synthetic import cost_report, format_cost_report

    log = (lambda s: None) if quiet else (lambda s: click.echo(s, err=True))
    if draft is None:
        raise click.UsageError("a synthetic target needs a synthetic --draft, e.g. -d synthetic:qwen2.5-0.5b")
    try:
        report = cost_report(target, draft, resolve_dtype(dtype), draft_lengths, acceptance, context, log=log)
    except (MlxspecError, ValueError) as e:
        raise click.ClickException(str(e))
    click.echo(format_cost_report(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"wrote {json_out}")


@click.command("bench")
@_with_options
@generation_options(groups=("drafting",), skip=("num_draft",))
def bench_command(target, draft, dtype, draft_lengths, max_tokens, repeats, prompt_file, kinds, per_kind,
                  temperature, seeds, compare_mlx_lm, warmup, json_out, plot_out, md_out, acceptance, context,
                  quiet, options: GenerateOptions) -> None:
    """Measure whether speculation is faster for a pair on this machine, and with which draft length.

    Runs a prompt suite with the target alone and with speculation for each draft length, and
    reports tokens/s, speedup, acceptance, the measured costs and the speedup they predict,
    time to first token and peak memory, then recommends a draft length.

    With random-weight models of named shapes (`-t synthetic:qwen2.5-7b -d synthetic:qwen2.5-0.5b`)
    it measures c and v(n) only and predicts the speedup of each draft length for an acceptance
    profile (--acceptance): which pair pays here, before downloading it.
    """
    from .loading import load

    if target.startswith("synthetic:"):
        _synthetic_bench(target, draft, dtype, draft_lengths, acceptance, context, json_out, quiet)
        return

    try:
        cfg = BenchConfig(
            draft_lengths=draft_lengths, max_tokens=max_tokens, repeats=repeats, temperature=temperature,
            seeds=seeds, compare_mlx_lm=compare_mlx_lm, warmup=warmup, drafting=options,
        )
        prompts = load_prompts(prompt_file, kinds, per_kind)
        dt = resolve_dtype(dtype)
        log = (lambda s: None) if quiet else (lambda s: click.echo(s, err=True))
        log(f"loading {target}" + (f" and {draft}" if draft else "") + f" ({dt or 'as stored'})")
        pair = load(target, draft, dtype=dt)
        report = run_bench(pair, prompts, cfg, log)
    except MlxspecError as e:
        raise click.ClickException(str(e))
    report["models"] = {
        "target": str(getattr(pair, "target_path", target)),
        "draft": str(getattr(pair, "draft_path", draft)),
        "dtype": dt or "as stored",
    }
    report["settings"]["prompt_file"] = str(prompt_file) if prompt_file else "built-in"
    report["settings"]["kinds"] = list(kinds) if kinds else None
    report["settings"]["per_kind"] = per_kind
    click.echo(format_report(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"wrote {json_out}")
    if plot_out:
        write_plot(report, plot_out)
        click.echo(f"wrote {plot_out}")
    if md_out:
        Path(md_out).write_text(format_markdown(report))
        click.echo(f"wrote {md_out}")
