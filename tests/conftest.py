"""Tiny random models built inside the tests (no downloads)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

VOCAB = 64


def importable_env(**extra: str) -> dict[str, str]:
    """os.environ for a child `sys.executable` that imports the same mlxspec and dependencies
    as this process, however they were installed (editable, wheel, PYTHONPATH): PYTHONPATH is
    the folder holding the imported mlxspec, then this process's sys.path. `extra` is added."""
    import os
    import sys

    import mlxspec

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(mlxspec.__file__)))
    paths = dict.fromkeys([pkg_root, *(os.path.abspath(p) for p in sys.path if p)])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def tiny_llama(seed: int, vocab: int = VOCAB, hidden: int = 32, layers: int = 2, scale: float = 4.0):
    """A 2-layer llama with its random init scaled up, so greedy output does not collapse."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * scale if p.ndim > 1 else p, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def perturbed(model, seed: int, noise: float):
    """A copy of model with Gaussian noise added to its matrices: a partly accepted draft."""
    copy = tiny_llama(0, vocab=model.args.vocab_size, hidden=model.args.hidden_size,
                      layers=model.args.num_hidden_layers)
    key = mx.random.key(seed)
    params = tree_map(lambda p: p, model.parameters())
    flat = []

    def add_noise(p):
        nonlocal key
        key, sub = mx.random.split(key)
        return p + noise * mx.random.normal(p.shape, key=sub) * p.std() if p.ndim > 1 else p

    copy.update(tree_map(add_noise, params))
    del flat
    mx.eval(copy.parameters())
    return copy


@pytest.fixture(scope="session")
def target():
    return tiny_llama(1)


@pytest.fixture(scope="session")
def unrelated():
    return tiny_llama(2)


@pytest.fixture(scope="session")
def near(target):
    return perturbed(target, seed=3, noise=0.05)


# -- tiny models saved as MLX folders with a real tokenizer ----------------------------------

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_tokenizer(folder, vocab: int = VOCAB, extra_word: str | None = None) -> None:
    """A word-level tokenizer: ids 0..5 are special tokens, the rest the words w6, w7, ..."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), vocab)]
    if extra_word is not None:
        words[-1] = extra_word
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }))


def save_tiny(folder, model, extra_word: str | None = None) -> None:
    from mlx_lm.utils import save_config, save_model

    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    a = model.args
    save_config({
        "model_type": "llama", "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size, "tie_word_embeddings": False, "rope_theta": a.rope_theta,
        "max_position_embeddings": 256, "torch_dtype": "float32", "eos_token_id": 2, "bos_token_id": 1,
    }, folder / "config.json")
    save_tokenizer(folder, a.vocab_size, extra_word)


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory, target, near):
    """A pair folder as `mlxspec convert --draft` writes it: target/, draft/, mlxspec-pair.json."""
    import json

    root = tmp_path_factory.mktemp("tiny-pair")
    save_tiny(root / "target", target)
    save_tiny(root / "draft", near)
    (root / "mlxspec-pair.json").write_text(
        json.dumps({"format": "mlxspec-pair", "version": 1, "target": "target", "draft": "draft"})
    )
    return root


@pytest.fixture(scope="session")
def mismatched_draft_dir(tmp_path_factory, unrelated):
    """A draft whose vocabulary differs from the tiny target's in one token."""
    root = tmp_path_factory.mktemp("mismatched")
    save_tiny(root, unrelated, extra_word="zzz")
    return root


# -- statistics of sampled output -------------------------------------------------------------

def exact_marginals(model, prompt, sp, steps):
    """Exact marginal distribution of each of the first `steps` sampled tokens, by enumerating
    every continuation with non-zero probability (use a small top-k)."""
    import numpy as np

    from mlxspec.sampling import probs

    seqs, weights = [list(prompt)], np.array([1.0])
    out = []
    for _ in range(steps):
        logits = model(mx.array(seqs))[:, -1]
        pr = np.array(probs(logits, sp), dtype=np.float64)  # (B, V)
        out.append((weights[:, None] * pr).sum(0))
        nz = [(b, v) for b in range(len(seqs)) for v in np.nonzero(pr[b] > 0)[0]]
        weights = np.array([weights[b] * pr[b, v] for b, v in nz])
        seqs = [seqs[b] + [int(v)] for b, v in nz]
    return out


def check_marginals(samples, exact, p_min=1e-4):
    """Chi-square test of each column of samples (n, steps) against the exact marginals; cells
    expected fewer than 5 times are merged so the approximation holds."""
    import numpy as np
    from scipy import stats as sstats

    n = samples.shape[0]
    for j in range(samples.shape[1]):
        counts = np.bincount(samples[:, j], minlength=exact[j].size).astype(float)
        keep = exact[j] > 0
        assert counts[~keep].sum() == 0, "a token outside the target's top-k was emitted"
        expected = exact[j][keep] / exact[j][keep].sum() * n
        big = expected >= 5
        obs = np.append(counts[keep][big], counts[keep][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        assert sstats.chisquare(obs, exp).pvalue > p_min, f"token {j} does not follow the target"
