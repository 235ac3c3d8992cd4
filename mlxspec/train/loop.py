"""Training the head: the training-time-test (TTT) unroll, the loss, and the resumable loop.

The unroll (EAGLE-3's "training-time test"), over a batch of B samples of T tokens:
    step 0:  x_0 = fc(taps_t),   token t+1's embedding,   rope at t
    step j:  x_j = h_{j-1} (the head's own pre-norm output at the same t),
             token t+j+1's embedding (the data's, or with feed_own the head's own draft),
             rope at t+j
    attention of step j at t: the step-0 keys of positions <= t (causal) and, of steps 1..j,
             only the key at t itself (the diagonal): exactly what the head's KV cache holds when
             it drafts its j-th token after position t.
    step j predicts token t+j+2: the target's distribution at position t+j+1.
Loss: sum_j decay^j * soft cross-entropy(target softmax over the draft vocabulary, head), over
positions whose target top token lies in the draft vocabulary.

The loop: AdamW, linear warm-up then cosine decay, gradient clipping, a checkpoint every N
steps written to a temporary folder and renamed (a killed run keeps the last good one), and
a data order that is a function of (seed, epoch), so a resumed run repeats exactly the
batches, and so the weights, of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..heads.eagle3 import Eagle3Head, load_head, save_head

CHECKPOINTS = "checkpoints"
STATE = "trainer.json"
OPT = "optimizer.npz"  # not .safetensors: a head folder loads every .safetensors file


# -- the unroll -------------------------------------------------------------------------------


def _shift(a: mx.array, n: int, fill=0) -> mx.array:
    """a[:, t + n] at t, `fill` past the end. a is (B, T, ...)."""
    if n == 0:
        return a
    pad = mx.full((a.shape[0], n, *a.shape[2:]), fill, dtype=a.dtype)
    return mx.concatenate([a[:, n:], pad], axis=1)


def _repeat_kv(x: mx.array, n_heads: int) -> mx.array:
    rep = n_heads // x.shape[1]
    return x if rep == 1 else mx.repeat(x, rep, axis=1)


def unroll(head: Eagle3Head, embed: Callable[[mx.array], mx.array], taps: mx.array, tokens: mx.array,
           steps: int, feed_own: bool = False) -> list[mx.array]:
    """Draft logits (B, T, draft_vocab) of each of `steps` unrolled steps. taps (B, T, F), tokens
    (B, T) target ids. With feed_own, step j > 0 embeds the head's own greedy token of step
    j-1 (evaluation: a greedy draft chain from every position at once)."""
    attn = head.midlayer.self_attn
    B, T = tokens.shape
    causal = mx.triu(mx.full((T, T), -mx.inf, dtype=mx.float32), k=1)
    x = head.fuse(taps)
    tok = _shift(tokens, 1)
    d2t_ids = mx.arange(head.d2t.shape[0], dtype=mx.int64) + head.d2t
    k0 = v0 = None
    diag: list[tuple[mx.array, mx.array]] = []
    out = []
    for j in range(steps):
        q, k, v = attn.project(head.midlayer.attn_input(embed(tok), x), offset=j)  # q (B, nh, T, D)
        k, v = _repeat_kv(k, attn.n_heads), _repeat_kv(v, attn.n_heads)
        if j == 0:
            k0, v0 = k, v
        else:
            diag.append((k, v))
        s0 = (q * attn.scale) @ k0.transpose(0, 1, 3, 2) + causal  # (B, nh, T, T)
        if diag:
            sd = mx.concatenate([((q * attn.scale) * kd).sum(-1, keepdims=True) for kd, _ in diag], axis=-1)
            p = mx.softmax(mx.concatenate([s0, sd], axis=-1), axis=-1, precise=True)
            o = p[..., :T] @ v0
            for i, (_, vd) in enumerate(diag):
                o = o + p[..., T + i:T + i + 1] * vd
        else:
            o = mx.softmax(s0, axis=-1, precise=True) @ v0
        h = head.midlayer.finish(x, attn.output(o))
        logits = head.logits(h)
        out.append(logits)
        x = h
        if feed_own:
            tok = d2t_ids[mx.argmax(logits, axis=-1)].astype(tokens.dtype)
        else:
            tok = _shift(tokens, j + 2)
    return out


@dataclass
class Batch:
    taps: mx.array  # (B, T, F) float16 -> float32 in the head
    hidden: mx.array  # (B, T, H) the target's final hidden states
    argmax: mx.array  # (B, T) the target's top token (full vocabulary)
    tokens: mx.array  # (B, T)
    valid: mx.array  # (B, T) bool: a real token, not padding


def make_batch(samples: list[dict[str, np.ndarray]]) -> Batch:
    T = max(len(s["tokens"]) for s in samples)

    def pad(k, dtype):
        a = np.zeros((len(samples), T, *samples[0][k].shape[1:]), dtype=dtype)
        for i, s in enumerate(samples):
            a[i, : len(s[k])] = s[k]
        return mx.array(a)

    valid = np.zeros((len(samples), T), dtype=bool)
    for i, s in enumerate(samples):
        valid[i, : len(s["tokens"])] = True
    return Batch(pad("taps", np.float16).astype(mx.float32), pad("hidden", np.float16).astype(mx.float32),
                 pad("argmax", np.int32), pad("tokens", np.int32), mx.array(valid))


def ttt_loss(head: Eagle3Head, embed, out_rows: mx.array, batch: Batch, steps: int, decay: float):
    """(weighted loss, per-step losses (steps,), per-step top-1 accuracies (steps,))."""
    tgt_logp = mx.stop_gradient(nn.log_softmax(batch.hidden @ out_rows.T, axis=-1))  # (B, T, Vd) at position t
    in_vocab = head.t2d[batch.argmax.astype(mx.int64)] & batch.valid
    target_top = mx.argmax(tgt_logp, axis=-1)
    logits = unroll(head, embed, batch.taps, batch.tokens, steps)
    total = mx.array(0.0)
    losses, accs = [], []
    for j, lg in enumerate(logits):
        m = _shift(in_vocab, j + 1, False).astype(mx.float32)  # the target at t + j + 1
        p = mx.exp(_shift(tgt_logp, j + 1))
        ce = -(p * nn.log_softmax(lg, axis=-1)).sum(-1)
        n = mx.maximum(m.sum(), 1.0)
        lj = (ce * m).sum() / n
        acc = ((mx.argmax(lg, axis=-1) == _shift(target_top, j + 1)).astype(mx.float32) * m).sum() / n
        total = total + (decay**j) * lj
        losses.append(lj)
        accs.append(acc)
    return total, mx.stack(losses), mx.stack(accs)


# -- acceptance of greedy draft chains on target-greedy trajectories ---------------------------


def chain_acceptance(head: Eagle3Head, embed, samples: list[dict[str, np.ndarray]], draft_length: int,
                     firsts: list[int] | None = None) -> dict:
    """Greedy speculative acceptance of the head on samples whose tokens are the target's own
    greedy continuation from index `first` on: from every position t (token t+1 the target's),
    the head drafts draft_length tokens feeding its own outputs; a draft is accepted while it
    equals the trajectory. firsts[i]: where sample i's greedy part begins. Returns acceptance per draft position (P(first k all accepted)) and
    tokens per target pass (1 + mean accepted)."""
    accepted = np.zeros(draft_length)
    starts = 0
    lengths = []
    for n, s in enumerate(samples):
        first = firsts[n] if firsts is not None else 0
        b = make_batch([s])
        logits = unroll(head, embed, b.taps, b.tokens, draft_length, feed_own=True)
        d2t_ids = np.arange(head.d2t.shape[0]) + np.array(head.d2t)
        drafts = np.stack([d2t_ids[np.array(mx.argmax(lg[0], axis=-1))] for lg in logits], axis=1)  # (T, K)
        toks = s["tokens"]
        T = len(toks)
        for t in range(max(first - 1, 0), T - draft_length - 1):
            ref = toks[t + 2: t + 2 + draft_length]
            ok = np.cumprod(drafts[t] == ref)
            accepted += ok
            lengths.append(int(ok.sum()))
            starts += 1
    if not starts:
        return {"positions": 0, "acceptance_per_position": [], "tokens_per_pass": None}
    return {
        "positions": starts,
        "acceptance_per_position": [round(float(a / starts), 4) for a in accepted],
        "tokens_per_pass": round(1.0 + float(np.mean(lengths)), 4),
    }


# -- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopSettings:
    steps: int
    batch_size: int
    ttt_steps: int
    lr: float
    warmup: int
    min_lr_ratio: float
    weight_decay: float
    clip: float
    decay: float
    seed: int
    checkpoint_every: int
    log_every: int


def schedule(s: LoopSettings):
    warm = max(1, s.warmup)
    decay_steps = max(1, s.steps - warm)
    return optim.join_schedules(
        [optim.linear_schedule(s.lr / warm, s.lr, warm),
         optim.cosine_decay(s.lr, decay_steps, s.lr * s.min_lr_ratio)],
        [warm],
    )


def batch_order(n_samples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The sample indices of (0-based) step `step`: epochs of seeded permutations, batches
    never crossing an epoch's end."""
    per_epoch = max(1, math.ceil(n_samples / batch_size))
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_samples)
    return perm[i * batch_size:(i + 1) * batch_size].tolist()


def _checkpoints(folder: Path) -> list[Path]:
    d = folder / CHECKPOINTS
    return sorted(p for p in d.glob("step-*") if p.is_dir() and (p / STATE).is_file()) if d.is_dir() else []


def last_checkpoint(folder: str | Path) -> Path | None:
    found = _checkpoints(Path(folder))
    return found[-1] if found else None


def save_checkpoint(folder: Path, head: Eagle3Head, opt: optim.Optimizer, state: dict, keep: int = 2) -> Path:
    """checkpoints/step-NNNNNN/ (head, optimizer, trainer state), written to a temporary folder
    and renamed; then the head is copied to folder/ itself with atomic file replaces."""
    root = folder / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state['step']:06d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(head, tmp)
    mx.savez(str(tmp / OPT), **dict(tree_flatten(opt.state)))
    (tmp / STATE).write_text(json.dumps(state))
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for f in ("model.safetensors", "config.json"):
        shutil.copyfile(final / f, folder / f".{f}.tmp")
        os.replace(folder / f".{f}.tmp", folder / f)
    for old in _checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def train(head: Eagle3Head, embed, out_rows: mx.array, features, s: LoopSettings, folder: Path, *,
          resume_from: Path | None = None, on_log: Callable[[dict], None] | None = None,
          on_checkpoint: Callable[[dict], None] | None = None, progress: bool = True,
          stop_after: int | None = None, extra_state: dict | None = None) -> dict:
    """Train head in place for s.steps steps; returns the trainer state. stop_after (tests)
    stops early after that many steps, as a killed run would (after its checkpoints)."""
    from tqdm import tqdm

    opt = optim.AdamW(learning_rate=schedule(s), betas=[0.9, 0.95], weight_decay=s.weight_decay)
    state = {"step": 0, "losses": [], **(extra_state or {})}
    if resume_from is not None:
        state = json.loads((resume_from / STATE).read_text())
        loaded = load_head(resume_from)
        head.update(loaded.parameters())
        opt.init(head.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(resume_from / OPT)).items()))
        mx.eval(head.parameters(), opt.state)

    def loss_fn(model, batch):
        total, losses, accs = ttt_loss(model, embed, out_rows, batch, s.ttt_steps, s.decay)
        return total, (losses, accs)

    step_fn = nn.value_and_grad(head, loss_fn)
    bar = tqdm(total=s.steps, initial=state["step"], unit="step", desc="training", disable=not progress,
               dynamic_ncols=True)
    window: list[tuple] = []
    t0, tokens = time.time(), 0
    while state["step"] < s.steps:
        idx = batch_order(len(features), s.batch_size, s.seed, state["step"])
        batch = make_batch([features.sample(i) for i in idx])
        (loss, (losses, accs)), grads = step_fn(head, batch)
        grads, norm = optim.clip_grad_norm(grads, s.clip)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss, losses, accs, norm)
        state["step"] += 1
        tokens += int(np.array(batch.valid).sum())
        window.append((loss.item(), np.array(losses), np.array(accs), norm.item()))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{float(accs[0]):.2f}")
        if state["step"] % s.log_every == 0 or state["step"] == s.steps:
            dt = time.time() - t0
            rec = {
                "kind": "train", "step": state["step"], "loss": round(float(np.mean([w[0] for w in window])), 5),
                "loss_per_step": np.round(np.mean([w[1] for w in window], axis=0), 5).tolist(),
                "acc_per_step": np.round(np.mean([w[2] for w in window], axis=0), 4).tolist(),
                "grad_norm": round(float(np.mean([w[3] for w in window])), 4),
                "lr": float(opt.learning_rate.item()), "tokens_per_s": round(tokens / dt, 1) if dt else None,
            }
            state["losses"].append([rec["step"], rec["loss"]])
            window, t0, tokens = [], time.time(), 0
            if on_log:
                on_log(rec)
        if state["step"] % s.checkpoint_every == 0 or state["step"] == s.steps:
            save_checkpoint(folder, head, opt, state)
            if on_checkpoint:
                on_checkpoint(dict(state))
        if stop_after is not None and state["step"] >= stop_after:
            break
    bar.close()
    return state
