"""The command-line flags of `GenerateOptions`, defined once for every command that generates.

    @click.command("chat")
    @generation_options(max_tokens=512)
    def chat_command(options: GenerateOptions, ...): ...

The decorator adds one flag per option field and hands the command a single validated
`options` argument instead of a dozen loose ones. `groups` picks the families a command
needs (bench sweeps its own lengths and temperature, so it takes only the drafting flags).
"""

from __future__ import annotations

import functools
from typing import Callable

import click

from .drafters import DRAFTERS
from .options import GenerateOptions

_FLAGS: dict[str, tuple[str, Callable[..., Callable]]] = {
    # field: (group, a function of the command's max_tokens default -> click option)
    "max_tokens": ("length", lambda n: click.option(
        "--max-tokens", "-n", type=click.IntRange(min=1), default=n, show_default=True,
        help="Most tokens to generate.")),
    "temperature": ("sampling", lambda n: click.option(
        "--temperature", "--temp", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
        help="0 is greedy.")),
    "top_p": ("sampling", lambda n: click.option(
        "--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)),
    "top_k": ("sampling", lambda n: click.option(
        "--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables it.")),
    "min_p": ("sampling", lambda n: click.option(
        "--min-p", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True, help="0 disables it.")),
    "seed": ("sampling", lambda n: click.option("--seed", type=int, default=None, help="Random seed for sampling.")),
    "drafter": ("drafting", lambda n: click.option(
        "--drafter", type=click.Choice(list(DRAFTERS)), default="auto", show_default=True,
        help="Who proposes tokens: the draft model, prompt lookup (copies from the prompt and the text so "
             "far; no draft model needed), lookup when it matches else the model, suffix (SuffixDecoding: "
             "frequency-weighted copies from the prompt, the output and earlier outputs; chains or, with "
             "--tree-nodes, trees), suffix when it matches else the model. auto: the draft (model or head) "
             "when there is one.")),
    "num_draft": ("drafting", lambda n: click.option(
        "--num-draft", "-k", type=click.IntRange(0, 64), default=4, show_default=True,
        help="Tokens drafted per target pass (0: no speculation).")),
    "adaptive": ("drafting", lambda n: click.option(
        "--adaptive/--no-adaptive", default=False, show_default=True,
        help="Adapt the draft length each round from the recent acceptance "
             "(--num-draft is then only the first round's).")),
    "draft_min": ("drafting", lambda n: click.option(
        "--draft-min", type=click.IntRange(min=1), default=1, show_default=True,
        help="Shortest draft (adaptive length and --draft-p-min).")),
    "draft_max": ("drafting", lambda n: click.option(
        "--draft-max", type=click.IntRange(min=1), default=None,
        help="Longest draft. Default: 16 with --adaptive, else --num-draft.")),
    "draft_p_min": ("drafting", lambda n: click.option(
        "--draft-p-min", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
        help="Stop a model draft when its top probability falls below this (a host wait per drafted token).")),
    "ngram_min": ("drafting", lambda n: click.option(
        "--ngram-min", type=click.IntRange(min=1), default=1, show_default=True, help="Shortest lookup n-gram.")),
    "ngram_max": ("drafting", lambda n: click.option(
        "--ngram-max", type=click.IntRange(min=1), default=4, show_default=True, help="Longest lookup n-gram.")),
    "tree_nodes": ("drafting", lambda n: click.option(
        "--tree-nodes", type=click.IntRange(0, 256), default=0, show_default=True,
        help="Draft token trees of up to N nodes, verified in one target pass (model and suffix "
             "drafters); 0: chains.")),
    "suffix_cache_tokens": ("drafting", lambda n: click.option(
        "--suffix-cache-tokens", type=click.IntRange(min=0), default=100_000, show_default=True,
        help="Suffix drafter: tokens of earlier outputs kept to copy from (oldest evicted first).")),
    "draft_vocab": ("drafting", lambda n: click.option(
        "--draft-vocab", type=click.IntRange(min=0), default=0, show_default=True,
        help="Draft among the N most frequent token ids only (a smaller output layer: cheaper draft "
             "steps, still exact); 0: the full vocabulary.")),
}


def generation_options(
    groups: tuple[str, ...] = ("length", "sampling", "drafting"), max_tokens: int = 256, skip: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Add the flags of the chosen option groups to a Click command, which then receives them
    as one `options: GenerateOptions` (fields not exposed keep their defaults)."""
    names = [n for n, (g, _) in _FLAGS.items() if g in groups and n not in skip]

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def run(*args, **kw):
            values = {n: kw.pop(n) for n in names}
            try:
                kw["options"] = GenerateOptions(**values)
            except ValueError as e:  # name the flags, not the fields
                msg = str(e)
                for n in sorted(names, key=len, reverse=True):
                    msg = msg.replace(n, "--" + n.replace("_", "-"))
                raise click.UsageError(msg) from None
            return f(*args, **kw)

        for n in reversed(names):
            run = _FLAGS[n][1](max_tokens)(run)
        return run

    return decorate
