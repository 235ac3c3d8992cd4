"""Drafters propose tokens; the engine verifies them with exact acceptance.

A drafter keeps whatever state it needs (a KV cache, an n-gram index) in step with the
sequence the engine hands it, and returns lazy arrays: proposing builds an MLX graph that the
engine evaluates together with verification, once per round. One module per drafter; this file
is the registry that maps a `drafter=` name to the function that builds it for a pair.

    base.py      Draft, the Drafter protocol, fit_vocab
    model.py     a small model of the target's family (ModelDrafter)
    lookup.py    prompt lookup over an incremental n-gram index (ngram.py)
    combined.py  a copier (lookup, suffix) when it matches, the model otherwise
    suffix.py    SuffixDecoding: chains or trees from what followed the context (suffix_index.py)
    tree_model.py  the draft model proposes token trees (tree_nodes > 0; chains otherwise)
    features.py  the target's tapped features in step with the sequence (trained heads)
    eagle3.py    an EAGLE-3 head drafts from the target's features (heads/eagle3.py)
    block_head.py  a DFlash or DSpark head drafts a block in one forward (heads/dflash.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..adaptive import weight_ratio
from ..cached_lm import CachedLM, common_prefix  # noqa: F401  (re-exported: drafters feed models too)
from ..errors import MlxspecError
from .base import Draft, Drafter, fit_vocab  # noqa: F401
from .combined import ModelCopierDrafter, ModelLookupDrafter  # noqa: F401
from .lookup import LookupDrafter
from .suffix import SuffixDrafter
from .tree_model import TreeModelDrafter
from .model import ModelDrafter, draft_vocab_ids

if TYPE_CHECKING:
    from ..engine import Pair
    from ..options import GenerateOptions


def _model(pair: "Pair", opts: "GenerateOptions") -> Drafter:
    ids = draft_vocab_ids(opts.draft_vocab, pair.vocab_size, pair.eos_token_ids) if opts.draft_vocab else None
    # a ModelDrafter that also drafts trees when the engine sets tree_nodes > 0
    return TreeModelDrafter(pair.draft, cost=weight_ratio(pair.draft, pair.target), vocab_ids=ids)


def _lookup(pair: "Pair", opts: "GenerateOptions") -> Drafter:
    return LookupDrafter(opts.ngram_min, opts.ngram_max)


def _model_lookup(pair: "Pair", opts: "GenerateOptions") -> Drafter:
    return ModelLookupDrafter(_model(pair, opts), _lookup(pair, opts), min_match=max(opts.ngram_min, 2))


def _suffix(pair: "Pair", opts: "GenerateOptions") -> Drafter:
    return SuffixDrafter(max_cached_tokens=opts.suffix_cache_tokens)


def _model_suffix(pair: "Pair", opts: "GenerateOptions") -> Drafter:
    return ModelCopierDrafter(_model(pair, opts), _suffix(pair, opts), min_match=2)


def _head(pair: "Pair", opts: "GenerateOptions") -> Drafter:
    return pair.head.make_drafter(pair, opts)  # heads/__init__.py: one drafter per head family


# name -> builder; NEEDS_DRAFT_MODEL: the names that cannot run without pair.draft (a draft
# model); NEEDS_HEAD: without pair.head (a trained head, heads/). Both come from `draft=` in
# mlxspec.load, so a name in either set needs the draft argument loaded (chat's wants_draft_model).
BUILDERS: dict[str, Callable[["Pair", "GenerateOptions"], Drafter]] = {
    "model": _model,
    "lookup": _lookup,
    "model+lookup": _model_lookup,
    "suffix": _suffix,
    "model+suffix": _model_suffix,
    "head": _head,
}
NEEDS_DRAFT_MODEL = {"model", "model+lookup", "model+suffix"}
NEEDS_HEAD = {"head"}
DRAFTERS = ("auto", *BUILDERS, "none")


def auto_drafter(pair: "Pair") -> str:
    """What drafter="auto" means for this pair: its trained head, else its draft model, else none."""
    if getattr(pair, "head", None) is not None:
        return "head"
    return "model" if pair.draft is not None else "none"


def build_drafter(pair: "Pair", opts: "GenerateOptions") -> Drafter | None:
    """The drafter that `opts` asks for, for this pair (None: decode with the target alone)."""
    name = auto_drafter(pair) if opts.drafter == "auto" else opts.drafter
    if not opts.speculates or name == "none":
        return None
    if name in NEEDS_DRAFT_MODEL and pair.draft is None:
        raise MlxspecError(
            f"drafter {name!r} needs a draft model: load one with "
            f"mlxspec.load(target, draft=...), or use drafter='lookup'"
        )
    if name in NEEDS_HEAD and getattr(pair, "head", None) is None:
        raise MlxspecError(
            f"drafter {name!r} needs a trained draft head: load one with "
            f"mlxspec.load(target, draft=HEAD_FOLDER), or use drafter='lookup'"
        )
    return BUILDERS[name](pair, opts)
