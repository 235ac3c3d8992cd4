"""The speculative decoding loop: draft, verify in one target pass, accept exactly, rewind.

One round:
    seq                       prompt + tokens so far; the target cache holds all but the last
    draft   x_1..x_k, q       drafter.propose (lazy)
    verify  p_1..p_{k+1}      one target forward over [last, x_1..x_k] (lazy)
    accept  n, t              exact rejection sampling / argmax match (lazy)
    ---- the host waits here, once, for [x_1..x_k, t, n] ----
    seq += x_1..x_n, t        caches are rewound by common prefix at the next round
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .accept import accept_greedy, accept_sampled
from .cached_lm import CachedLM, common_prefix
from .drafters import Draft, Drafter, build_drafter
from .errors import MlxspecError
from .options import GenerateOptions, resolve
from .sampling import SamplingParams, probs, sample
from .tree import depths, forward_tree, is_chain, keep_path
from .tree_accept import accept_tree_deterministic, accept_tree_greedy, accept_tree_sampled

Prompt = Union[str, Sequence[int], Sequence[dict]]


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (fewer when a session reuses its cache)
    prefill_time: float = 0.0
    generation_tokens: int = 0
    decode_time: float = 0.0
    rounds: int = 0  # target forward passes after the prefill
    drafted: int = 0
    accepted: int = 0
    draft_time: float | None = None  # measured only with profile=True (costs a host wait)
    verify_time: float | None = None
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # emitted tokens per proposer
    finish_reason: str | None = None  # "stop" (end-of-sequence token) or "length"
    peak_memory: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens per target forward pass: 1 + accepted drafts per pass (1.0 without
        speculation; a pass that produced the stop token counts that token)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generation_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    def position_acceptance(self) -> list[float]:
        """How often draft position i was accepted when it was drafted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_round=self.tokens_per_round,
            tokens_per_second=self.tokens_per_second,
            prefill_tokens_per_second=self.prefill_tokens_per_second,
            position_acceptance=self.position_acceptance(),
        )
        return d

    def _record_round(self, k: int, n: int, nodes: int | None = None) -> None:
        """A round that drafted k tokens (a tree: `nodes` nodes, k deep) and accepted n."""
        self.rounds += 1
        self.drafted += k if nodes is None else nodes
        self.accepted += n
        grow = k - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(n):
            self.accepted_per_position[i] += 1


@dataclass
class Chunk:
    text: str
    tokens: list[int]
    from_draft: list[bool]  # one per token: True when the draft proposed it
    stats: Stats
    finish_reason: str | None = None  # set on the last chunk


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    from_draft: list[bool]
    stats: Stats


class Session:
    """KV caches kept across calls (a chat): a new call feeds only what differs from the
    tokens the caches already hold."""

    def __init__(self, target: nn.Module, drafter: Drafter | None):
        self.target = CachedLM(target, "target")
        self.drafter = drafter
        self.tokens: list[int] = []  # the sequence so far (prompt + generated)
        if drafter is not None and hasattr(drafter, "attach"):
            drafter.attach(self.target)  # drafters that read the target's state (trained heads)

    @property
    def cached_tokens(self) -> int:
        return self.target.offset


class Pair:
    """A target model and an optional draft model, sharing one tokenizer (or, instead of the
    draft model, a trained head: heads.TrainedHead, which drafts from the target's features)."""

    def __init__(self, target_model: nn.Module, draft_model: nn.Module | None = None, tokenizer=None, head=None):
        self.target = target_model
        self.draft = draft_model
        self.head = head
        self.tokenizer = tokenizer
        self.eos_token_ids: set[int] = stop_tokens(tokenizer)
        self.vocab_size = _vocab_size(target_model)

    # -- prompts -------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special = not (bos and prompt.startswith(bos))
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer with a chat template")
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this tokenizer has no chat template; pass plain text instead")
            text = self.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def make_drafter(self, options: GenerateOptions | None = None, **changes) -> Drafter | None:
        """The drafter that the options ask for (drafters/__init__.py has the names): "auto" is
        the draft model when the pair has one, else none."""
        return build_drafter(self, resolve(options, changes))

    def new_session(self, options: GenerateOptions | None = None, **changes) -> Session:
        """KV caches (and a drafter) to keep across calls, e.g. the turns of a chat."""
        return Session(self.target, self.make_drafter(options, **changes))

    # -- public API ----------------------------------------------------------------------
    def generate(
        self, prompt: Prompt, options: GenerateOptions | None = None, *, session: Session | None = None, **changes
    ) -> GenerationResult:
        """Generate a reply to prompt. `options` (GenerateOptions) or keyword changes to them:
        max_tokens, temperature, top_p, top_k, min_p, seed, drafter, num_draft, adaptive, ..."""
        tokens: list[int] = []
        from_draft: list[bool] = []
        text = []
        stats = Stats()
        for chunk in self.stream(prompt, options, session=session, **changes):
            tokens += chunk.tokens
            from_draft += chunk.from_draft
            text.append(chunk.text)
            stats = chunk.stats
        return GenerationResult("".join(text), tokens, from_draft, stats)

    def stream(
        self, prompt: Prompt, options: GenerateOptions | None = None, *, session: Session | None = None, **changes
    ) -> Iterator[Chunk]:
        """Like generate, one Chunk per round as it is decided."""
        opts = resolve(options, changes)
        ids = self.encode(prompt)
        if session is None:
            session = self.new_session(opts)
        elif opts.drafter != "auto":
            have = session.drafter.name if session.drafter is not None else "none"
            if have != opts.drafter:
                raise ValueError(
                    f"this session drafts with {have!r}; make one with "
                    f"pair.new_session(drafter={opts.drafter!r}) to draft with {opts.drafter!r}"
                )
        return self._stream(ids, opts, session)

    # -- the loop ------------------------------------------------------------------------
    def _stream(self, ids: list[int], cfg: GenerateOptions, session: Session) -> Iterator[Chunk]:
        stats = Stats(prompt_tokens=len(ids))
        if cfg.profile:
            stats.draft_time = stats.verify_time = 0.0
        detok = self.tokenizer.detokenizer if self.tokenizer is not None else None
        if detok is not None:
            detok.reset()
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(7), "little")
        key = mx.random.key(seed)
        target, drafter = session.target, session.drafter
        if drafter is not None and not cfg.speculates:
            drafter = None
        if drafter is not None and hasattr(drafter, "p_min"):  # early stop (model drafts only)
            drafter.p_min, drafter.min_tokens = cfg.draft_p_min, cfg.draft_min
        if drafter is not None and hasattr(drafter, "tree_nodes"):  # drafters that can draft trees
            drafter.tree_nodes = cfg.tree_nodes

        mx.reset_peak_memory()
        tic = time.perf_counter()
        reused = common_prefix(target.tokens, ids)
        target.prefill(ids)
        if drafter is not None:
            drafter.prefill(ids)
        mx.eval([c.state for c in target.cache])
        stats.prefill_tokens = len(ids) - 1 - min(reused, len(ids) - 1)
        stats.prefill_time = time.perf_counter() - tic

        seq = list(ids)
        session.tokens = seq
        produced = 0
        tic = time.perf_counter()
        rounds = (
            self._plain_rounds(target, seq, cfg, key, stats)
            if drafter is None
            else self._spec_rounds(target, drafter, seq, cfg, key, stats)
        )
        try:
            for new, n_draft, source in rounds:
                # new: the round's tokens (n accepted drafts, then the target's token)
                finish = None
                emit = new
                for i, t in enumerate(new):
                    if t in self.eos_token_ids:
                        emit, finish = new[:i], "stop"
                        break
                if finish is None and produced + len(emit) >= cfg.max_tokens:
                    emit, finish = emit[: cfg.max_tokens - produced], "length"
                # the sequence keeps a stop token (a chat turn ends with it), not tokens past it
                seq.extend(emit + [new[len(emit)]] if finish == "stop" else emit)
                produced += len(emit)
                flags = [i < n_draft for i in range(len(emit))]
                stats.generation_tokens = produced
                for f in flags:
                    src = source if f else "target"
                    stats.tokens_by_source[src] = stats.tokens_by_source.get(src, 0) + 1
                stats.decode_time = time.perf_counter() - tic
                text = ""
                if detok is not None:
                    for t in emit:
                        detok.add_token(t)
                    if finish is not None:
                        detok.finalize()
                    text = detok.last_segment
                if finish is not None:
                    stats.finish_reason = finish
                    stats.peak_memory = mx.get_peak_memory()
                    yield Chunk(text, emit, flags, stats, finish)
                    return
                yield Chunk(text, emit, flags, stats)
        finally:
            rounds.close()  # the caches may hold rejected or unused tokens: the next sync trims them
            session.tokens = seq

    def _plain_rounds(
        self, target: CachedLM, seq: list[int], cfg: GenerateOptions, key: mx.array, stats: Stats
    ) -> Iterator[tuple[list[int], int, str]]:
        """Target alone, pipelined like mlx-lm: the next step's graph is queued before the host
        reads the current token."""
        sp = cfg.sampling

        def step(y: mx.array, key: mx.array) -> mx.array:
            logits = target.forward(y)[-1]
            return sample(logits, sp, key)

        feed = target.sync(seq)
        target.tokens.extend(feed)
        key, sub = _split(key, 2, sp)
        y = step(mx.array(feed, mx.uint32), sub)
        mx.async_eval(y)
        while True:
            key, sub = _split(key, 2, sp)
            nxt = step(y[None], sub)
            mx.async_eval(nxt)
            t = y.item()
            target.tokens.append(t)
            stats._record_round(0, 0)
            yield [t], 0, "target"
            y = nxt

    def _spec_rounds(
        self,
        target: CachedLM,
        drafter: Drafter,
        seq: list[int],
        cfg: GenerateOptions,
        key: mx.array,
        stats: Stats,
    ) -> Iterator[tuple[list[int], int, str]]:
        sp = cfg.sampling
        produced = 0
        policy = cfg.length_policy(getattr(drafter, "costs", {}))
        # the length policy's key for the next round: "model", or "lookup/<match size>" (lookup's
        # acceptance depends on how long its match is); model+lookup also decides who drafts
        next_source = getattr(drafter, "next_source", None)
        while True:
            key, k_draft, k_accept = _split(key, 3, sp)
            source = next_source(seq) if next_source is not None else getattr(drafter, "name", "draft")
            # a tree's node budget is tree_nodes (its depth at most that); a chain's length the policy's
            tree = cfg.tree_nodes > 0 and hasattr(drafter, "tree_nodes")
            k = min(cfg.tree_nodes if tree else policy.k(source), cfg.max_tokens - produced - 1)
            t0 = time.perf_counter()
            draft = drafter.propose(seq, k, sp, k_draft, self.vocab_size) if k > 0 else None
            if draft is not None and draft.size == 0:
                draft = None
            if cfg.profile and draft is not None:
                mx.eval([a for a in (draft.tokens, draft.q) if a is not None])
                stats.draft_time += time.perf_counter() - t0
            t1 = time.perf_counter()
            if draft is not None and draft.parents is not None:
                if is_chain(draft.parents):  # one child per node: the chain path, same rule
                    draft = Draft(draft.tokens, draft.q, draft.source)
                else:
                    new, n = self._tree_round(target, drafter, seq, draft, sp, k_accept, stats)
                    if cfg.profile:
                        stats.verify_time += time.perf_counter() - t1
                    produced += len(new)
                    yield new, n, draft.source
                    continue
            n, token = self._verify(target, seq, draft, sp, k_accept)
            k = draft.size if draft is not None else 0
            parts = [token[None], n[None].astype(mx.uint32)]
            if draft is not None:
                parts.insert(0, draft.tokens)
            vals = mx.concatenate(parts).tolist()  # the one host wait of the round
            if cfg.profile:
                stats.verify_time += time.perf_counter() - t1
            n = vals[-1]
            drafted = vals[:k]
            target.tokens.extend(drafted)  # the target cache now holds seq + drafts
            if draft is not None:
                drafter.commit(drafted)
            stats._record_round(k, n)
            if draft is not None:
                policy.update(source, k, n)
            new = drafted[:n] + [vals[k]]
            produced += len(new)
            yield new, n, draft.source if draft is not None else "target"

    def _tree_round(
        self, target: CachedLM, drafter: Drafter, seq: list[int], draft: Draft, sp: SamplingParams,
        key: mx.array, stats: Stats,
    ) -> tuple[list[int], int]:
        """Verify a token tree in one target pass (tree.py), accept exactly (tree_accept.py), keep
        the accepted path in both caches. Returns (accepted drafts + the target's token, n)."""
        parents, size = draft.parents, draft.size
        feed = target.sync(seq)
        logits = forward_tree(target, feed, draft.tokens, parents)[len(feed) - 1 :]  # (N+1, V): root, nodes
        if sp.greedy:
            best = mx.argmax(logits, axis=-1).astype(mx.uint32)
            vals = mx.concatenate([draft.tokens.astype(mx.uint32), best]).tolist()  # the round's host wait
            tokens = vals[:size]
            path, token = accept_tree_greedy(tokens, parents, vals[size:])
        else:
            p, u = probs(logits, sp), mx.random.uniform(shape=(size + 1,), key=key)
            mx.eval(draft.tokens, p, u)
            tokens = draft.tokens.tolist()
            if draft.q is None:
                path, token = accept_tree_deterministic(tokens, parents, np.array(p), np.array(u))
            else:
                path, token = accept_tree_sampled(tokens, parents, np.array(draft.q), np.array(p), np.array(u))
        kept = [tokens[i] for i in path]
        keep_path(target, size, path, kept)
        drafter.commit_tree(path, tokens)
        stats._record_round(max(depths(parents)), len(path), nodes=size)
        return kept + [token], len(path)

    def _verify(
        self, target: CachedLM, seq: list[int], draft: Draft | None, sp: SamplingParams, key: mx.array
    ) -> tuple[mx.array, mx.array]:
        feed = target.sync(seq)
        inp = mx.array(feed, mx.uint32)
        if draft is None:
            logits = target.forward(inp, known=feed)[-1]
            return mx.array(0), sample(logits, sp, key)
        k = draft.size
        inp = mx.concatenate([inp, draft.tokens])
        logits = target.forward(inp, known=feed)[-(k + 1):]  # (k+1, V)
        if sp.greedy:
            return accept_greedy(draft.tokens, logits)
        return accept_sampled(draft.tokens, draft.q, probs(logits, sp), key)


# end-of-generation tokens that chat models emit besides their tokenizer's eos token (the
# same idea as llama.cpp's EOG set): Qwen's <|endoftext|> after <|im_end|>, Llama 3's <|eot_id|>...
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>")


def stop_tokens(tokenizer) -> set[int]:
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    try:
        special = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
        vocab = tokenizer.get_vocab()
    except Exception:
        return ids
    ids |= {vocab[t] for t in END_OF_GENERATION if t in special and t in vocab}
    return ids


def _split(key: mx.array, n: int, sp: SamplingParams) -> list[mx.array]:
    """n keys from key. Greedy decoding draws no random numbers, so it reuses the key instead of
    growing a chain of splits that is never evaluated."""
    return [key] * n if sp.greedy else list(mx.random.split(key, n))


def _vocab_size(model: nn.Module) -> int:
    """The width of the model's logits (the embedding may be padded past the tokenizer)."""
    cache = None
    try:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        return int(model(mx.array([[0]], mx.uint32), cache=cache).shape[-1])  # shape only: not evaluated
    except Exception as e:  # pragma: no cover - a model that cannot run one token
        raise MlxspecError(f"cannot run {type(model).__name__} on one token: {e}") from e

