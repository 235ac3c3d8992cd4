"""Random-weight models of real shapes, to time a pair on your own hardware before downloading it.

    mlxspec bench -t synthetic:qwen2.5-7b -d synthetic:qwen2.5-0.5b --dtype bfloat16
    mlxspec bench -t synthetic:llama3-70b:q4 -d synthetic:llama3.2-1b:q4 --acceptance earlier-bench.json
    pair = mlxspec.load("synthetic:qwen2.5-1.5b", draft="synthetic:qwen2.5-0.5b", dtype="float32")

The time of a forward pass does not depend on the weights' values, only on the shapes, the dtype
and the quantization, so c (draft step / target step) and v(n) (target forward over n tokens /
over one) measured on random weights are those of the real models. Acceptance is not: it comes
from a real run (`mlxspec bench --json`) or a stated default.

A spec is `synthetic:SHAPE[:OPTION...]`: SHAPE one of SHAPES, options `q4`/`q8` (quantized
weights, group size 64, as mlx-community's 4- and 8-bit repos), `untied`/`tied` (a separate
output layer or the embedding's, as released by default), `layers=N`, `vocab=N` (smaller
variants; the tests use them). The dtype is the one `load` gets (bfloat16 when none is given).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from .errors import ModelNotFoundError, ModelTooLargeError

PREFIX = "synthetic:"

_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768)
_QWEN3 = dict(model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
              head_dim=128, vocab_size=151936)
_LLAMA3 = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500_000.0, max_position_embeddings=131072,
               vocab_size=128256)
_GEMMA3 = dict(model_type="gemma3_text", rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768, vocab_size=262144,
               query_pre_attn_scalar=256, tie_word_embeddings=True)


def _s(base: dict, hidden: int, layers: int, inter: int, heads: int, kv: int, **more) -> dict:
    return {**base, "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
            "num_attention_heads": heads, "num_key_value_heads": kv, **more}


# The published configs' shapes (hidden, layers, MLP width, attention heads, KV heads, vocabulary).
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": _s(_QWEN25, 896, 24, 4864, 14, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": _s(_QWEN25, 1536, 28, 8960, 12, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": _s(_QWEN25, 2048, 36, 11008, 16, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": _s(_QWEN25, 3584, 28, 18944, 28, 4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": _s(_QWEN25, 5120, 48, 13824, 40, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": _s(_QWEN25, 5120, 64, 27648, 40, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": _s(_QWEN25, 8192, 80, 29568, 64, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen3-0.6b": _s(_QWEN3, 1024, 28, 3072, 16, 8, tie_word_embeddings=True),
    "qwen3-1.7b": _s(_QWEN3, 2048, 28, 6144, 16, 8, tie_word_embeddings=True),
    "qwen3-4b": _s(_QWEN3, 2560, 36, 9728, 32, 8, tie_word_embeddings=True),
    "qwen3-8b": _s(_QWEN3, 4096, 36, 12288, 32, 8, tie_word_embeddings=False),
    "qwen3-14b": _s(_QWEN3, 5120, 40, 17408, 40, 8, tie_word_embeddings=False),
    "qwen3-32b": _s(_QWEN3, 5120, 64, 25600, 64, 8, tie_word_embeddings=False),
    "llama3.2-1b": _s(_LLAMA3, 2048, 16, 8192, 32, 8, tie_word_embeddings=True),
    "llama3.2-3b": _s(_LLAMA3, 3072, 28, 8192, 24, 8, tie_word_embeddings=True),
    "llama3-8b": _s(_LLAMA3, 4096, 32, 14336, 32, 8, tie_word_embeddings=False),
    "llama3-70b": _s(_LLAMA3, 8192, 80, 28672, 64, 8, tie_word_embeddings=False),
    "gemma3-270m": _s(_GEMMA3, 640, 18, 2048, 4, 1, head_dim=256),
    "gemma3-1b": _s(_GEMMA3, 1152, 26, 6912, 4, 1, head_dim=256),
    "gemma3-4b": _s(_GEMMA3, 2560, 34, 10240, 8, 4, head_dim=256, vocab_size=262208),
    "gemma3-12b": _s(_GEMMA3, 3840, 48, 15360, 16, 8, head_dim=256, vocab_size=262208),
    "gemma3-27b": _s(_GEMMA3, 5376, 62, 21504, 32, 16, head_dim=128, query_pre_attn_scalar=168,
                     vocab_size=262208),
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GROUP_SIZE = 64


def is_synthetic(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


@dataclass(frozen=True)
class SyntheticSpec:
    shape: str
    config: dict  # mlx-lm ModelArgs fields
    bits: int | None = None  # quantized weights (group size 64)

    @classmethod
    def parse(cls, spec: str) -> "SyntheticSpec":
        if not is_synthetic(spec):
            raise ModelNotFoundError(f"not a synthetic model spec: {spec!r} (expected {PREFIX}SHAPE)")
        name, *opts = spec[len(PREFIX):].split(":")
        if name not in SHAPES:
            raise ModelNotFoundError(f"no synthetic shape {name!r}; known: {', '.join(SHAPES)}")
        config, bits = dict(SHAPES[name]), None
        for opt in opts:
            key, _, value = opt.partition("=")
            try:
                if opt in ("q4", "q8", "q2", "q3", "q6"):
                    bits = int(opt[1:])
                elif opt in ("tied", "untied"):  # converted GGUFs often carry a separate output layer
                    config["tie_word_embeddings"] = opt == "tied"
                elif key == "layers" and int(value) > 0:
                    config["num_hidden_layers"] = int(value)
                    if "sliding_window_pattern" in config:  # Gemma: every 6th layer global, if there are 6
                        config["sliding_window_pattern"] = min(config["sliding_window_pattern"], int(value))
                elif key == "vocab" and int(value) > 0:
                    config["vocab_size"] = int(value)
                else:
                    raise ValueError
            except ValueError:
                raise ModelNotFoundError(
                    f"bad option {opt!r} in {spec!r}: use q4 or q8 (quantized), untied or tied (output "
                    "layer), layers=N or vocab=N") from None
        return cls(name, config, bits)

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the weights as `build` makes them (computed from the shapes, nothing allocated)."""
        return sum(_nbytes(shape, quantized, dtype, self.bits) for shape, quantized in self._weights())

    def _weights(self) -> list[tuple[tuple[int, ...], bool]]:
        """(shape, quantized under qN) of every weight."""
        c = self.config
        h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        hd = c.get("head_dim") or h // c["num_attention_heads"]
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        per_layer = [((q, h), True), ((kv, h), True), ((kv, h), True), ((h, q), True),
                     ((inter, h), True), ((inter, h), True), ((h, inter), True), ((h,), False), ((h,), False)]
        if c["model_type"] == "qwen2":
            per_layer += [((q,), False), ((kv,), False), ((kv,), False)]  # q/k/v biases
        if c["model_type"] in ("qwen3", "gemma3_text"):
            per_layer += [((hd,), False), ((hd,), False)]  # q/k norms
        if c["model_type"] == "gemma3_text":
            per_layer += [((h,), False), ((h,), False)]  # pre/post feed-forward norms
        out = per_layer * layers + [((vocab, h), True), ((h,), False)]
        if not c.get("tie_word_embeddings", False):
            out.append(((vocab, h), True))
        return out


def _nbytes(shape: tuple[int, ...], quantized: bool, dtype: str, bits: int | None) -> int:
    n = 1
    for d in shape:
        n *= d
    if quantized and bits:  # packed weights, plus a scale and a bias per group in `dtype`
        return n * bits // 8 + 2 * (n // GROUP_SIZE) * DTYPE_BYTES[dtype]
    return n * DTYPE_BYTES[dtype]


def available_memory() -> int | None:
    """Bytes a model may take here: the GPU's recommended working set on a Mac, else the memory
    the OS reports available (MemAvailable: other processes' use counts), else physical memory."""
    import mlx.core as mx

    try:
        info = mx.device_info()
        if info.get("max_recommended_working_set_size"):
            return int(info["max_recommended_working_set_size"])
        if mx.default_device() != mx.cpu and info.get("memory_size"):
            return int(info["memory_size"])
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    from .platform import physical_memory

    return physical_memory()


def check_fits(specs: list[tuple[str, int]], budget: int | None = None) -> None:
    """Refuse (ModelTooLargeError) when the weights of `specs` [(label, bytes)] together exceed
    90% of the available memory."""
    budget = available_memory() if budget is None else budget
    total = sum(b for _, b in specs)
    if budget and total > 0.9 * budget:
        what = " + ".join(f"{label} {b / 2**30:.1f} GiB" for label, b in specs)
        raise ModelTooLargeError(
            f"{what} of weights do not fit in the {budget / 2**30:.1f} GiB available here; pick a "
            "smaller shape, a quantized one (:q4), or a smaller --dtype")


def build(spec: str, dtype: str | None = None, budget: int | None = None):
    """A random-weight mlx-lm model of the spec's shape, in `dtype` (default bfloat16), quantized
    when the spec says so. Refuses before allocating when it cannot fit; allocates layer by layer."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    from .loading import DTYPES

    dtype = dtype or "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    s = SyntheticSpec.parse(spec)
    check_fits([(spec, s.weight_bytes(dtype))], budget)
    module = importlib.import_module(f"mlx_lm.models.{s.config['model_type']}")
    args = module.ModelArgs.from_dict(s.config)
    model = module.Model(args)  # parameters are lazy: nothing is allocated yet
    # Values do not change the time of a forward; drawing billions of random numbers on a CPU
    # would (about 15M a second here). Matrices get a random block of 1M values repeated.
    block = mx.random.normal((1 << 20,), key=mx.random.key(0)) * 0.02

    def fill(p: mx.array) -> mx.array:
        if p.ndim < 2:
            return p
        return mx.tile(block, (-(-p.size // block.size),))[: p.size].reshape(p.shape)

    model.update(tree_map(fill, model.parameters()))
    if s.config.get("tie_word_embeddings") and "lm_head" in model:  # gemma3_text: tied, as released
        model.pop("lm_head")
        model.tie_word_embeddings = True
    model.set_dtype(DTYPES[dtype])
    if s.bits:
        nn.quantize(model, group_size=GROUP_SIZE, bits=s.bits)
    for layer in model.model.layers:  # one layer's float32 init at a time, then its cast
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    model.synthetic = spec
    return model


def load_pair(target: str, draft: str | None, dtype: str | None):
    """mlxspec.load for synthetic specs: a Pair with no tokenizer (prompts are token ids)."""
    from .engine import Pair

    if draft is not None and not is_synthetic(draft):
        raise ModelNotFoundError("a synthetic target needs a synthetic draft (or none): they time the same way")
    dt = dtype or "bfloat16"
    parts = [(target, SyntheticSpec.parse(target).weight_bytes(dt))]
    if draft is not None:
        parts.append((draft, SyntheticSpec.parse(draft).weight_bytes(dt)))
    check_fits(parts)
    pair = Pair(build(target, dt), build(draft, dt) if draft is not None else None, None)
    pair.target_path, pair.draft_path = target, draft
    return pair


# -- timing one model at a time ------------------------------------------------------------------


def time_forwards(model, ids: list[int], ns: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of a forward over n tokens (n in ns) after `ids` are in the KV cache (trimmed
    back after every forward); the ns interleaved, after one warm-up round."""
    import statistics
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    from .bench import _prefill

    cache = _prefill(model, ids)
    feed = (list(ids) * (max(ns) // len(ids) + 1))[: max(ns)]
    times: dict[int, list[float]] = {n: [] for n in ns}
    for rep in range(repeats + 1):
        for n in ns:
            x = mx.array(feed[:n], mx.uint32)[None]
            mx.eval(x)
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            dt = time.perf_counter() - t0
            trim_prompt_cache(cache, n)
            if rep:
                times[n].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}


def release(model) -> None:
    import mlx.core as mx

    del model
    gc.collect()
    mx.clear_cache()


def context_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids to stand for a prompt (random; the cost of attention depends on the length only)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(min(vocab, 32000)) for _ in range(n)]


# -- the cost-model report: c and v(n) measured here, acceptance from a real run ------------------

DEFAULT_ALPHA = 0.8  # per-token acceptance when no real run is given (i.i.d.)


def acceptance_profile(source: str | None, max_k: int) -> dict:
    """s_1..s_max_k, how often draft position i is accepted, from `source`: a number (each token
    accepted with that probability, i.i.d.), a `mlxspec bench --json` report (its longest draft's
    per-position acceptance, extended geometrically with its per-token rate), or None (the default)."""
    import json
    from pathlib import Path

    if source is None or _is_number(source):
        alpha = DEFAULT_ALPHA if source is None else float(source)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"an acceptance rate must be in [0, 1], got {alpha}")
        what = "default" if source is None else "given"
        return {"source": f"{what}: each draft token accepted with probability {alpha:g} (i.i.d.)",
                "alpha": alpha, "survival": [alpha ** i for i in range(1, max_k + 1)]}
    path = Path(source)
    try:
        report = json.loads(path.read_text())
        entries = [e for e in report["results"] if e.get("engine") == "mlxspec" and e.get("position_acceptance")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(
            f"--acceptance {source}: not a number in [0, 1] nor a readable `mlxspec bench --json` report ({e})") from None
    if not entries:
        raise ModelNotFoundError(f"--acceptance {source}: the report has no speculative results with per-position acceptance")
    best = max(entries, key=lambda e: e["num_draft"])
    surv = list(best["position_acceptance"])[: best["num_draft"]]
    alpha = float(best.get("alpha_iid", best.get("acceptance_rate", DEFAULT_ALPHA)))
    while len(surv) < max_k:
        surv.append(surv[-1] * alpha if surv else alpha)
    models = report.get("models", {})
    return {"source": f"{path} (k={best['num_draft']}, {models.get('target', '?')} + {models.get('draft', '?')})",
            "alpha": alpha, "survival": surv[:max_k]}


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def cost_report(target: str, draft: str, dtype: str | None, draft_lengths: tuple[int, ...], acceptance: str | None,
                context: int = 128, repeats: int = 5, log=None, budget: int | None = None) -> dict:
    """Build the synthetic target and draft, measure c and v(n) (both models at once when they
    fit together, interleaved; else one at a time), and predict the speedup of each draft length."""
    from types import SimpleNamespace

    from .bench import Costs, expected_tokens, measure_costs, predicted_speedup, round_cost
    from .platform import machine_description

    log = log or (lambda s: None)
    dt = dtype or "bfloat16"
    if not is_synthetic(draft):
        raise ModelNotFoundError("a synthetic target needs a synthetic --draft (e.g. -d synthetic:qwen2.5-0.5b)")
    specs = {role: SyntheticSpec.parse(spec) for role, spec in (("target", target), ("draft", draft))}
    sizes = {role: s.weight_bytes(dt) for role, s in specs.items()}
    for role, spec in (("target", target), ("draft", draft)):
        check_fits([(spec, sizes[role])], budget)  # each alone must fit
    max_n = max(draft_lengths) + 1
    profile = acceptance_profile(acceptance, max(draft_lengths))
    import mlx.core as mx

    if mx.default_device() == mx.cpu and (dt != "float32" or any(sp.bits for sp in specs.values())):
        log("note: on MLX's CPU backend 16-bit and quantized matmuls are many times slower than float32 "
            "(a 1.5B q4 pair did not finish timing in 500 s on 2 cores); --dtype float32 is what runs fast here")
    ids = context_ids(context, min(s.config["vocab_size"] for s in specs.values()))
    try:
        check_fits([(target, sizes["target"]), (draft, sizes["draft"])], budget)
        together = True
    except ModelTooLargeError:
        together = False
    if together:
        log(f"building {target} and {draft} ({dt}, random weights)")
        t, d = build(target, dt, budget), build(draft, dt, budget)
        log(f"timing target forwards over 1..{max_n} tokens and a draft step, interleaved, {repeats} repeats")
        costs = measure_costs(SimpleNamespace(target=t, draft=d), ids, max_n, repeats)
        release(t)
        release(d)
    else:
        log(f"building {target} ({dt}, random weights); the pair does not fit at once: one model at a time")
        t = build(target, dt, budget)
        verify = time_forwards(t, ids, list(range(1, max_n + 1)), repeats)
        release(t)
        log(f"building {draft}")
        d = build(draft, dt, budget)
        step = time_forwards(d, ids, [1], repeats)[1]
        release(d)
        costs = Costs(context_tokens=len(ids), target_step=verify[1], draft_step=step,
                      verify=[verify[n] for n in range(1, max_n + 1)])
    predictions = []
    for k in draft_lengths:
        e = expected_tokens(profile["survival"], k)
        predictions.append({"num_draft": k, "expected_tokens_per_round": e,
                            "round_cost": round_cost(k, costs.c, costs.v),
                            "predicted_speedup": predicted_speedup(e, k, costs.c, costs.v)})
    best = max(predictions, key=lambda p: p["predicted_speedup"])
    return {
        "synthetic": True,
        "models": {"target": target, "draft": draft, "dtype": dt},
        "weights_bytes": sizes,
        "timed_together": together,
        "costs": costs.to_dict(),
        "acceptance": profile,
        "predictions": predictions,
        "recommendation": {
            "num_draft": best["num_draft"] if best["predicted_speedup"] > 1.0 else None,
            "predicted_speedup": best["predicted_speedup"],
        },
        "machine": machine_description(),
    }


def format_cost_report(r: dict) -> str:
    from .bench import describe_machine

    c, m = r["costs"], r["models"]
    gib = {k: v / 2**30 for k, v in r["weights_bytes"].items()}
    lines = [
        f"synthetic target {m['target']} ({gib['target']:.2f} GiB), draft {m['draft']} ({gib['draft']:.2f} GiB), {m['dtype']}",
        "machine: " + describe_machine(r["machine"]),
        f"costs ({'interleaved' if r['timed_together'] else 'one model at a time'}, context {c['context_tokens']} tokens): "
        f"target step {c['target_step_s'] * 1e3:.1f} ms, draft step {c['draft_step_s'] * 1e3:.1f} ms, c = {c['c']:.3f}",
        "verify cost v(n), n = 1.." + str(len(c["v"])) + ": " + " ".join(f"{x:.2f}" for x in c["v"]),
        "acceptance: " + r["acceptance"]["source"],
        "",
        f"{'k':>3} {'tokens/round':>12} {'round cost':>10} {'predicted speedup':>17}",
    ]
    for p in r["predictions"]:
        lines.append(f"{p['num_draft']:>3} {p['expected_tokens_per_round']:>12.2f} {p['round_cost']:>10.2f} "
                     f"{p['predicted_speedup']:>16.2f}x")
    rec = r["recommendation"]
    lines.append("")
    if rec["num_draft"] is None:
        lines.append(f"prediction: speculation would not pay for this pair here (best {rec['predicted_speedup']:.2f}x)")
    else:
        lines.append(f"prediction: draft length {rec['num_draft']}, {rec['predicted_speedup']:.2f}x over the target alone "
                     "(random weights time like real ones; the acceptance is the assumption above)")
    return "\n".join(lines)
