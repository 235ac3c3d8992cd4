"""`train_drafter`: data -> target features -> draft vocabulary -> TTT training -> evaluation,
with everything a run leaves in its output folder:

    OUT/config.json, model.safetensors   the head (heads/eagle3.py layout), replaced atomically at
                                         every checkpoint, so OUT always loads as a draft
    OUT/mlxspec-train.json               provenance: target, data files and hash, tokens, vocabulary,
                                         settings, steps, losses, evaluation
    OUT/train-log.jsonl                  one line per logged step and per evaluation
    OUT/loss.png                         the loss curve (and held-out acceptance per position)
    OUT/checkpoints/step-NNNNNN/         head + optimizer state + trainer state (the last two kept)
    OUT/features/                        cached target features (train, held-out), reused by
                                         later runs and --resume
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..errors import MlxspecError
from . import data as data_mod
from . import features as feat_mod

PROVENANCE = "mlxspec-train.json"
LOG = "train-log.jsonl"


@dataclass(frozen=True)
class TrainSettings:
    """Every setting of a training run (the CLI builds this; provenance records it)."""

    draft_vocab: int = 16384
    ttt_steps: int = 5
    epochs: float = 1.0  # used when steps is None
    steps: int | None = None
    batch_size: int = 2  # samples per step (padded)
    max_tokens_per_sample: int = 512
    max_tokens: int | None = None  # cap on training tokens
    held_out_fraction: float = 0.05
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.05  # fraction of the steps (or a step count when >= 1)
    weight_decay: float = 0.0
    clip: float = 0.5
    decay: float = 0.8  # loss weight of unrolled step j is decay**j
    intermediate_size: int | None = None  # the head's MLP width (default: the target's)
    tap_layers: tuple[int, ...] | None = None
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    eval_prompts: int = 4
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 48
    eval_draft_length: int = 5
    chunk: int = 256  # prefill chunk while extracting features
    dtype: str | None = None
    init_from_target: bool = True  # lm_head and norm start as the target's (draft-vocabulary rows)
    engine_eval: bool = True  # at the end, generate from the held-out prompts with the real engine


def load_target(spec: str | Path, dtype: str | None):
    """(model, tokenizer, folder) of a target folder (a pair folder gives its target)."""
    from ..loading import _load_one, check_memory, read_pair_manifest, resolve_model

    path = resolve_model(spec)
    pair = read_pair_manifest(path)
    if pair is not None:
        path = pair[0]
    check_memory([path], dtype)
    model, tok = _load_one(path, dtype)
    return model, tok, path


def _sha(samples: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(np.asarray(s, dtype=np.int32).tobytes() + b"|")
    return h.hexdigest()


def target_identity(folder: Path, dtype: str | None) -> dict:
    cfg = (folder / "config.json").read_bytes()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"path": str(folder.resolve()), "config_sha256": hashlib.sha256(cfg).hexdigest(),
            "weights_bytes": size, "dtype": dtype}


@dataclass
class Prepared:
    target: object
    tokenizer: object
    target_path: Path
    corpus: data_mod.Corpus
    tap_layers: tuple[int, ...]
    train: feat_mod.Features
    held_out: feat_mod.Features | None
    timings: dict = field(default_factory=dict)


def prepare(target: str | Path, data: Sequence[str | Path], out: str | Path, settings: TrainSettings, *,
            features_dir: str | Path | None = None, progress: bool = True, loaded=None) -> Prepared:
    """Load, read the data, and compute (or reuse) the train and held-out features."""
    from ..heads.eagle3 import default_taps
    from ..heads.taps import decoder_layers
    from ..engine import stop_tokens

    if loaded is None:
        model, tok, path = load_target(target, settings.dtype)
    else:
        model, tok, path = loaded
    docs, files, digest = data_mod.read_documents(data)
    corpus = data_mod.build_corpus(
        docs, tok, max_tokens_per_sample=settings.max_tokens_per_sample, min_tokens=settings.ttt_steps + 2,
        held_out_fraction=settings.held_out_fraction, max_tokens=settings.max_tokens, seed=settings.seed,
        sources=files, data_hash=digest,
    )
    taps = tuple(settings.tap_layers or default_taps(len(decoder_layers(model))))
    ident = target_identity(Path(path), settings.dtype)
    fdir = Path(features_dir) if features_dir is not None else Path(out) / "features"
    t0 = time.time()
    key = {"target": ident, "taps": list(taps), "samples": len(corpus.train), "tokens_sha256": _sha(corpus.train)}
    train = feat_mod.extract(model, corpus.train, fdir / "train", taps, key, chunk=settings.chunk,
                             progress=progress, desc="target features")
    t1 = time.time()
    held = None
    prompts = [s[: settings.eval_prompt_tokens] for s in corpus.held_out[: settings.eval_prompts]]
    if prompts:
        stop = stop_tokens(tok)
        n = settings.eval_new_tokens
        hkey = {"target": ident, "taps": list(taps), "greedy_new_tokens": n, "prompts_sha256": _sha(prompts)}
        held = feat_mod.extract(
            model, prompts, fdir / "held-out", taps, hkey, chunk=settings.chunk, progress=progress,
            desc="held-out (target greedy)",
            make=lambda t, r, p: feat_mod.greedy_features(t, r, p, n, settings.chunk, stop),
        )
    made = {name: (feat_mod._read_manifest(fdir / name) or {}).get("seconds") for name in ("train", "held-out")}
    return Prepared(model, tok, Path(path), corpus, taps, train, held,
                    {"train_features_s": round(t1 - t0, 1), "held_out_features_s": round(time.time() - t1, 1),
                     "extraction_s_when_made": made, "folder": str(fdir)})


def _settings_key(s: TrainSettings) -> dict:
    """The settings a checkpoint must share with a run that resumes it."""
    d = asdict(s)
    for k in ("checkpoint_every", "log_every", "eval_prompts", "eval_prompt_tokens", "eval_new_tokens",
              "eval_draft_length", "chunk", "engine_eval"):
        d.pop(k)
    d["tap_layers"] = list(d["tap_layers"]) if d["tap_layers"] is not None else None
    return d


def _init_from_target(head, target, vocab_ids) -> None:
    """lm_head := the target's output rows of the draft vocabulary, norm := its final norm (the
    head's pre-norm state then starts in the target's own output space)."""
    rows = feat_mod.output_rows(target, vocab_ids)
    head.lm_head.weight = rows.astype(head.lm_head.weight.dtype)
    norm = getattr(feat_mod._inner(target), "norm", None)
    w = getattr(norm, "weight", None)
    if w is not None and w.shape == head.norm.weight.shape:
        head.norm.weight = w.astype(head.norm.weight.dtype)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def train_drafter(target: str | Path, data: Sequence[str | Path], out: str | Path, settings: TrainSettings = TrainSettings(),
                  *, resume: bool = False, features_dir: str | Path | None = None, progress: bool = True,
                  echo: Callable[[str], None] = print, stop_after: int | None = None, loaded=None) -> dict:
    """Train an EAGLE-3 head for target on data into out; returns the provenance dict.
    resume continues from out's last checkpoint (same settings, same data: identical result)."""
    from ..engine import stop_tokens
    from ..heads.eagle3 import Eagle3Head, head_config_for
    from .evaluate import held_out_acceptance, plot_curve, read_log
    from .loop import LoopSettings, last_checkpoint, train
    from .vocab import counts_array, draft_vocab

    out = Path(out)
    ckpt = last_checkpoint(out)
    if ckpt is not None and not resume:
        raise MlxspecError(f"{out} already holds a training run (last checkpoint {ckpt.name}); "
                           "add --resume to continue it, or choose another --out")
    if resume and ckpt is None and (out / PROVENANCE).is_file():
        raise MlxspecError(f"{out} has no checkpoint to resume from")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prep = prepare(target, data, out, settings, features_dir=features_dir, progress=progress, loaded=loaded)
    model, corpus = prep.target, prep.corpus
    echo(f"data: {corpus.documents} documents, {corpus.train_tokens} training tokens in {len(corpus.train)} samples, "
         f"{corpus.held_out_tokens} held-out tokens")

    # frequencies over all the training documents, not only the (capped) samples that get features:
    # a token seen only there still has a trained-like logit, the head's lm_head starting as the target's
    vocab = draft_vocab(counts_array(corpus.vocab_counts, model.args.vocab_size), settings.draft_vocab,
                        stop_tokens(prep.tokenizer))
    echo(f"draft vocabulary: {vocab.size} tokens ({vocab.distinct} distinct in the data), "
         f"covering {vocab.coverage:.1%} of the training documents' tokens")
    cfg = head_config_for(model, vocab.size, prep.tap_layers, settings.intermediate_size)
    mx.random.seed(settings.seed)
    head = Eagle3Head(cfg)
    head.set_vocab(mx.array(vocab.d2t), mx.array(vocab.t2d))
    if settings.init_from_target:
        _init_from_target(head, model, vocab.ids)
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    out_rows = feat_mod.output_rows(model, vocab.ids)
    inner = feat_mod._inner(model)
    inner.freeze()

    def embed(ids: mx.array) -> mx.array:
        return mx.stop_gradient(inner.embed_tokens(ids).astype(mx.float32))

    per_epoch = -(-len(prep.train) // settings.batch_size)
    steps = settings.steps or max(1, round(settings.epochs * per_epoch))
    warmup = int(settings.warmup if settings.warmup >= 1 else settings.warmup * steps)
    loop = LoopSettings(steps=steps, batch_size=settings.batch_size, ttt_steps=settings.ttt_steps, lr=settings.lr,
                        warmup=warmup, min_lr_ratio=settings.min_lr_ratio, weight_decay=settings.weight_decay,
                        clip=settings.clip, decay=settings.decay, seed=settings.seed,
                        checkpoint_every=settings.checkpoint_every, log_every=settings.log_every)
    held_firsts = [min(len(s), settings.eval_prompt_tokens) for s in corpus.held_out[: settings.eval_prompts]]
    if prep.held_out is None:
        echo("no held-out text (too few documents, or --held-out 0): acceptance is not measured")
    skey = _settings_key(settings)
    log_path = out / LOG
    resume_from = None
    if resume and ckpt is not None:
        st = json.loads((ckpt / "trainer.json").read_text())
        if st.get("settings") != skey or st.get("train_key") != prep.train.key:
            raise MlxspecError(f"{ckpt} was made with other settings or data; resume needs the same ones")
        resume_from = ckpt
        kept = [r for r in read_log(log_path) if r.get("step", 0) <= st["step"]]
        log_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        echo(f"resuming from {ckpt.name}")
    else:
        log_path.write_text("")

    def log(rec: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def evaluate(step: int) -> dict | None:
        if prep.held_out is None:
            return None
        acc = held_out_acceptance(head, embed, prep.held_out, held_firsts, settings.eval_draft_length)
        rec = {"kind": "eval", "step": step, **acc}
        log(rec)
        return rec

    base = {
        "format": "mlxspec-train", "version": 1,
        "target": target_identity(prep.target_path, settings.dtype),
        "data": {"paths": [str(p) for p in data], "files": corpus.sources, "sha256": corpus.data_hash,
                 "documents": corpus.documents, "train_samples": len(corpus.train),
                 "train_tokens": corpus.train_tokens, "held_out_samples": len(corpus.held_out),
                 "held_out_tokens": corpus.held_out_tokens, "train_documents": len(corpus.train_sources),
                 "held_out_documents": sorted(corpus.held_out_sources)},
        "draft_vocab": {"size": vocab.size, "requested": settings.draft_vocab, "distinct_in_data": vocab.distinct,
                        "coverage": round(vocab.coverage, 4)},
        "head": cfg.to_dict(), "settings": {**skey, **asdict(settings), "tap_layers": list(prep.tap_layers)},
        "steps": steps, "warmup_steps": warmup, "features": prep.timings,
    }

    def provenance(state: dict, final: bool) -> dict:
        logs = read_log(log_path)
        evals = [r for r in logs if r["kind"] == "eval"]
        trains = [r for r in logs if r["kind"] == "train"]
        p = {**base, "complete": final, "step": state["step"], "losses": state["losses"],
             "last_train": trains[-1] if trains else None, "eval_untrained": evals[0] if evals and evals[0]["step"] == 0 else None,
             "eval": evals[-1] if evals else None, "seconds": round(time.time() - started, 1)}
        _write_json(out / PROVENANCE, p)
        try:
            plot_curve(logs, out / "loss.png", title=f"{'/'.join(prep.target_path.parts[-2:])}: {corpus.train_tokens} tokens, "
                                                     f"draft vocab {vocab.size}, TTT {settings.ttt_steps}")
        except Exception as e:  # a plot is not worth a failed run
            echo(f"(no loss plot: {e})")
        return p

    if resume_from is None:
        r = evaluate(0)
        if r:
            echo(f"untrained head: acceptance per position {r['acceptance_per_position']}, "
                 f"{r['tokens_per_pass']} tokens/pass")

    def on_checkpoint(state: dict) -> None:
        r = evaluate(state["step"])
        state = {**state}
        provenance(state, final=False)
        if r:
            echo(f"step {state['step']}: held-out acceptance {r['acceptance_per_position']}, {r['tokens_per_pass']} tokens/pass")

    train_state = {"settings": skey, "train_key": prep.train.key}
    state = train(head, embed, out_rows, prep.train, loop, out, resume_from=resume_from, on_log=log,
                  on_checkpoint=on_checkpoint, progress=progress, stop_after=stop_after, extra_state=train_state)
    if state["step"] < steps:  # stopped early (stop_after): OUT stays at its last checkpoint
        return json.loads((out / PROVENANCE).read_text()) if (out / PROVENANCE).is_file() else {"step": 0}
    if settings.engine_eval and prep.held_out is not None:
        from .evaluate import engine_acceptance

        prompts = [s[: settings.eval_prompt_tokens] for s in corpus.held_out[: settings.eval_prompts]]
        t0 = time.time()
        base["engine_eval"] = {**engine_acceptance(model, prep.tokenizer, out, prompts, settings.eval_new_tokens,
                                                   settings.eval_draft_length), "seconds": round(time.time() - t0, 1)}
        e = base["engine_eval"]
        echo(f"engine (greedy, {settings.eval_draft_length} drafts per pass): acceptance per position "
             f"{e['acceptance_per_position']}, {e['tokens_per_pass']} tokens/pass")
    return provenance(state, final=True)
