"""`mlxspec chat` and `mlxspec generate`: the commands people type every day.

A chat keeps one engine `Session` (the target's and the draft's KV caches) for the whole
conversation. The session's token sequence is the source of truth: a new turn is the tokens
already cached up to the end of the last reply, plus the template's text that follows it (end
of the assistant turn, the new user message, the generation prompt), so the engine prefills
only the new message, whatever the template would make of the reply if it re-rendered it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TextIO

import click

from .cli_options import generation_options
from .drafters import NEEDS_DRAFT_MODEL, NEEDS_HEAD
from .errors import MlxspecError
from .options import GenerateOptions

HELP = """Commands:
  /reset   start a new conversation (clears the history and the caches)
  /stats   this session's acceptance and speed
  /help    this help
  /quit    leave (Ctrl-D or Ctrl-C at an empty prompt too)
Ctrl-C during a reply stops the reply; the conversation stays."""


# -- loading ----------------------------------------------------------------------------------


def auto_dtype(dtype: str) -> str | None:
    """auto: float32 on MLX's CPU backend (its fastest path), else the stored dtype."""
    if dtype != "auto":
        return dtype
    import mlx.core as mx

    return "float32" if mx.default_device().type == mx.DeviceType.cpu else None


def load_pair(target: str | None, draft: str | None, use_draft: bool, dtype: str):
    """Resolve the specs and load; every failure a user can act on becomes one line."""
    from .loading import load
    from .resolve import resolve_pair

    res = resolve_pair(target, draft, use_draft)
    where = res.target + (f" + draft {res.draft}" if res.draft else "")
    click.echo(f"Loading {res.label} ({where}) ...", err=True)
    tic = time.perf_counter()
    try:
        pair = load(res.target, res.draft, dtype=auto_dtype(dtype))
    except MlxspecError:
        raise
    except Exception as e:  # mlx-lm's own errors on a folder it cannot read (bad config, weights)
        raise MlxspecError(f"could not load {where}: {type(e).__name__}: {e}") from e
    pair.label = res.label
    drafted = ("with its draft" if pair.draft is not None else
               f"with a trained {pair.head.family} head" if getattr(pair, "head", None) is not None else "without a draft")
    click.echo(f"Loaded in {time.perf_counter() - tic:.1f} s ({drafted}).", err=True)
    return pair


def max_context(pair) -> int | None:
    """The target's maximum length (max_position_embeddings), or None when it does not say."""
    path = getattr(pair, "target_path", None)
    if path is not None and (Path(path) / "config.json").is_file():
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg) if "max_position_embeddings" not in cfg else cfg
        if cfg.get("max_position_embeddings"):
            return int(cfg["max_position_embeddings"])
    n = getattr(getattr(pair.target, "args", None), "max_position_embeddings", None)
    return int(n) if n else None


# -- one reply, streamed -------------------------------------------------------------------


def drafts(options: GenerateOptions, pair) -> bool:
    """Whether these options speculate with this pair (an explicit drafter that needs a missing
    draft model says so when the session is made)."""
    has = pair.draft is not None or getattr(pair, "head", None) is not None
    return options.speculates and (options.drafter != "auto" or has)


def wants_draft_model(no_draft: bool, options: GenerateOptions) -> bool:
    """Whether to load the draft (a draft model or a trained head) at all (lookup needs none)."""
    needs = NEEDS_DRAFT_MODEL | NEEDS_HEAD
    return not no_draft and options.speculates and (options.drafter == "auto" or options.drafter in needs)


class StopFlag:
    """Ctrl-C while a reply streams: the first press asks the engine to stop after the current
    step (caches stay consistent), a second press interrupts at once."""

    def __init__(self) -> None:
        self.hits = 0

    def _handler(self, signum, frame) -> None:
        self.hits += 1
        if self.hits >= 2:
            raise KeyboardInterrupt

    @contextmanager
    def armed(self) -> Iterator["StopFlag"]:
        self.hits = 0
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        prev = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, prev)


@dataclass
class Reply:
    tokens: list[int]
    text: str
    stats: object  # engine Stats of the last chunk (None when nothing came)
    ttft: float | None  # seconds from the request to the first token
    interrupted: bool = False  # Ctrl-C ended it early
    aborted: bool = False  # a second Ctrl-C broke into the engine: its caches may be inconsistent


class TokenPrinter:
    """Writes tokens as they come, through a detokenizer of its own; with show_draft, the
    tokens the draft proposed are green (only on a terminal)."""

    def __init__(self, tokenizer, out: TextIO | None, show_draft: bool):
        self.detok = tokenizer.detokenizer  # a fresh copy each access
        self.detok.reset()
        self.out = out
        self.colour = show_draft and out is not None and out.isatty()

    def add(self, tokens: list[int], from_draft: list[bool]) -> None:
        for t, d in zip(tokens, from_draft):
            self.detok.add_token(t)
            self._write(self.detok.last_segment, d)

    def finish(self) -> None:
        self.detok.finalize()
        self._write(self.detok.last_segment, False)

    def _write(self, seg: str, draft: bool) -> None:
        if not seg or self.out is None:
            return
        self.out.write(click.style(seg, fg="green") if self.colour and draft else seg)
        self.out.flush()


def stream_reply(
    pair, ids: list[int], options: GenerateOptions, session, out: TextIO | None, show_draft: bool,
    stop: StopFlag | None,
) -> Reply:
    """Generate one reply to the prompt ids, printing it as it comes. Ctrl-C (via `stop`) ends
    the reply early; the tokens so far are kept."""
    printer = TokenPrinter(pair.tokenizer, out, show_draft)
    tokens: list[int] = []
    stats, ttft, interrupted, aborted = None, None, False, False
    tic = time.perf_counter()
    if session is not None:
        options = options.replace(drafter="auto")  # the session's drafter drafts
    gen = pair.stream(ids, options, session=session)
    try:
        for chunk in gen:
            if ttft is None and chunk.tokens:
                ttft = time.perf_counter() - tic
            tokens += chunk.tokens
            stats = chunk.stats
            printer.add(chunk.tokens, chunk.from_draft)
            if stop is not None and stop.hits:
                interrupted = True
                break
    except KeyboardInterrupt:
        interrupted = aborted = True
    finally:
        gen.close()  # the engine's finally leaves the caches consistent for the next turn
        printer.finish()
    return Reply(tokens, pair.tokenizer.decode(tokens), stats, ttft, interrupted, aborted)


def stats_line(stats, ttft: float | None, has_draft: bool) -> str:
    if stats is None:
        return "[no tokens]"
    parts = [f"{stats.generation_tokens} tokens", f"{stats.tokens_per_second:.1f} tok/s"]
    if has_draft and stats.drafted:
        parts.append(f"{stats.acceptance_rate:.0%} accepted")
        sources = {k: v for k, v in stats.tokens_by_source.items() if k != "target"}
        if set(sources) - {"model"}:  # lookup proposed some: say who proposed the accepted tokens
            if len(sources) > 1 or set(sources) & {"lookup", "suffix"}:  # a head drafts alone
                sources.setdefault("model", 0)
            parts.append("from " + ", ".join(f"{k} {v}" for k, v in sorted(sources.items())))
    parts.append(f"{stats.tokens_per_round:.2f} tokens/pass")
    if ttft is not None:
        parts.append(f"first token {ttft:.2f} s")
    return "[" + ", ".join(parts) + "]"


# -- the conversation -----------------------------------------------------------------------


@dataclass
class Totals:
    turns: int = 0
    tokens: int = 0
    decode_time: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)

    def add(self, r: Reply) -> None:
        self.turns += 1
        st = r.stats
        if st is None:
            return
        self.tokens += st.generation_tokens
        self.decode_time += st.decode_time
        self.rounds += st.rounds
        self.drafted += st.drafted
        self.accepted += st.accepted
        self.prompt_tokens += st.prompt_tokens
        self.prefill_tokens += st.prefill_tokens
        if r.ttft is not None:
            self.ttfts.append(r.ttft)

    def lines(self, has_draft: bool, context: str) -> list[str]:
        tps = self.tokens / self.decode_time if self.decode_time > 0 else 0.0
        out = [f"turns: {self.turns}, tokens generated: {self.tokens}, {tps:.1f} tok/s"]
        if has_draft:
            rate = self.accepted / self.drafted if self.drafted else 0.0
            out.append(f"draft: {self.accepted}/{self.drafted} accepted ({rate:.0%})")
        per_pass = self.tokens / self.rounds if self.rounds else 0.0
        out.append(f"tokens per target pass: {per_pass:.2f}")
        if self.ttfts:
            mean = sum(self.ttfts) / len(self.ttfts)
            out.append(f"first token: mean {mean:.2f} s, last {self.ttfts[-1]:.2f} s")
        out.append(
            f"prompt tokens: {self.prompt_tokens}, computed: {self.prefill_tokens} (the rest came from the cache)"
        )
        out.append(f"context: {context}")
        return out


class ContextFull(MlxspecError):
    pass


class Conversation:
    """A multi-turn chat over one engine session: history, token sequence and caches."""

    def __init__(self, pair, system: str | None = None, options: GenerateOptions | None = None):
        tok = pair.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise MlxspecError("this model's tokenizer has no chat template; use `mlxspec generate` without --chat")
        self.pair = pair
        self.system = system
        self.options = options or GenerateOptions(max_tokens=512)
        self.max_len = max_context(pair)
        self.totals = Totals()
        self.reset()

    @property
    def has_draft(self) -> bool:
        return drafts(self.options, self.pair)

    def new_session(self):
        return self.pair.new_session(self.options if self.has_draft else self.options.replace(drafter="none"))

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.session = self.new_session()
        self.tokens: list[int] = []  # what the session's caches stand for
        self.reply_end: int | None = None  # len of tokens up to the end of the last reply's text
        self.last_prompt_text: str | None = None

    def _render(self, messages: list[dict]) -> str:
        return self.pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.pair.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, user: str) -> tuple[list[int], str, bool]:
        """(ids, rendered text, reused) for the next turn. When the template renders the
        history as before plus the reply, the ids are the cached tokens up to the end of the
        reply plus the new tail: the caches hold them already, whatever the tokenizer would
        make of the reply's text."""
        text = self._render(self.messages + [{"role": "user", "content": user}])
        if self.reply_end is not None and self.last_prompt_text is not None:
            head = self.last_prompt_text + self.messages[-1]["content"]
            if text.startswith(head):
                return self.tokens[: self.reply_end] + self._encode(text[len(head):]), text, True
        return self._encode(text), text, False

    def context_text(self) -> str:
        used = len(self.tokens)
        return f"{used} of {self.max_len} tokens" if self.max_len else f"{used} tokens"

    def turn(
        self, user: str, out: TextIO | None = None, show_draft: bool = False, stop: StopFlag | None = None,
        on_limit: Callable[[str], None] | None = None,
    ) -> Reply:
        ids, text, _ = self.prompt_ids(user)
        s = self.options
        max_tokens = s.max_tokens
        if self.max_len is not None:
            room = self.max_len - len(ids)
            if room < 1:
                raise ContextFull(
                    f"this message would make the conversation {len(ids)} tokens long, past the model's "
                    f"context window of {self.max_len} tokens; type /reset to start a new conversation"
                )
            if room < max_tokens:
                max_tokens = room
                if on_limit is not None:
                    on_limit(
                        f"the context window is nearly full ({len(ids)} of {self.max_len} tokens): this reply "
                        f"can be at most {room} tokens; /reset starts a new conversation"
                    )
        seed = None if s.seed is None else s.seed + self.totals.turns
        reply = stream_reply(self.pair, ids, s.replace(max_tokens=max_tokens, seed=seed), self.session, out,
                             show_draft, stop)
        if reply.aborted:
            # the engine stopped anywhere: drop its caches; the next turn prefills the
            # conversation again from the tokens seen so far
            self.session = self.new_session()
            self.tokens = ids + reply.tokens
        else:
            self.tokens = list(self.session.tokens)  # prompt, reply and its stop token if any
        self.reply_end = len(ids) + len(reply.tokens)
        self.last_prompt_text = text
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply.text}]
        self.totals.add(reply)
        return reply


# -- the commands ---------------------------------------------------------------------------


def _model_options(f):
    opts = [
        click.option("--target", "-t", default=None, metavar="MODEL",
                     help="Local MLX folder, pair folder, recipe name (models/*.json) or Hugging Face repo. "
                          "Default: the default pair recipe."),
        click.option("--draft", "-d", default=None, metavar="MODEL",
                     help="Draft model (same forms as --target). Default: the pair's own draft, if any."),
        click.option("--no-draft", is_flag=True, help="Decode with the target alone."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
                     show_default=True, help="auto: float32 on a CPU backend, else the stored dtype."),
        click.option("--show-draft", is_flag=True, help="Colour the tokens that came from the draft (green)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except MlxspecError as e:
        raise click.ClickException(str(e)) from None


@click.command("chat")
@_model_options
@generation_options(max_tokens=512)
@click.option("--system", "-s", default=None, help="System message.")
def chat_command(target, draft, no_draft, dtype, show_draft, options: GenerateOptions, system):
    """Chat with a model, speculative decoding on.

    Keeps the KV caches across turns: a new turn computes only the new message. Inside the
    chat: /reset, /stats, /help, /quit. Ctrl-C stops a reply. With standard input from a pipe,
    each line is one message and each reply one line of standard output.
    """
    with _user_errors():
        pair = load_pair(target, draft, wants_draft_model(no_draft, options), dtype)
        conv = Conversation(pair, system, options.replace(drafter="none") if no_draft else options)
    if sys.stdin.isatty():
        _interactive(conv, show_draft)
    else:
        _piped(conv, show_draft)


def _say(msg: str, dim: bool = True) -> None:
    sys.stdout.flush()
    click.echo(click.style(msg, dim=True) if dim and sys.stderr.isatty() else msg, err=True)


def _command(conv: Conversation, line: str) -> bool:
    """Run a /command; False means quit."""
    cmd = line.split()[0].lower()
    if cmd in ("/quit", "/exit", "/q"):
        return False
    if cmd == "/reset":
        conv.reset()
        _say("New conversation.")
    elif cmd == "/stats":
        for ln in conv.totals.lines(conv.has_draft, conv.context_text()):
            _say(ln)
    elif cmd in ("/help", "/?"):
        _say(HELP)
    else:
        _say(f"Unknown command {cmd}; /help lists the commands.")
    return True


def _one_turn(conv: Conversation, line: str, show_draft: bool, stop: StopFlag, piped: bool = False) -> None:
    try:
        with stop.armed():
            reply = conv.turn(line, sys.stdout, show_draft, stop, on_limit=_say)
    except ContextFull as e:
        _say(str(e), dim=False)
        if piped:  # still one line out per message in, for scripts that read them in step
            sys.stdout.write("\n")
            sys.stdout.flush()
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if reply.interrupted:
        _say("[stopped]")
    _say(stats_line(reply.stats, reply.ttft, conv.has_draft))


def _interactive(conv: Conversation, show_draft: bool) -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover
        pass
    draft = "with its draft" if conv.has_draft else "no draft"
    _say(f"mlxspec chat: {conv.pair.label} ({draft}). /help for commands, Ctrl-D to leave.")
    stop = StopFlag()
    while True:
        try:
            line = input(click.style(">>> ", fg="cyan", bold=True))
        except (EOFError, KeyboardInterrupt):
            click.echo("")
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not _command(conv, line):
                return
            continue
        _one_turn(conv, line, show_draft, stop)


def _piped(conv: Conversation, show_draft: bool) -> None:
    stop = StopFlag()
    try:
        for raw in sys.stdin:
            line = raw.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not _command(conv, line):
                    return
                continue
            _one_turn(conv, line, show_draft, stop, piped=True)
    except KeyboardInterrupt:
        return


@click.command("generate")
@_model_options
@generation_options(max_tokens=256)
@click.option("--prompt", "-p", required=True, help='The prompt; "-" reads it from standard input.')
@click.option("--chat", "use_chat", is_flag=True, help="Apply the model's chat template to the prompt.")
@click.option("--system", "-s", default=None, help="System message (with --chat).")
@click.option("--json", "as_json", is_flag=True, help="Print the text and full stats as one JSON object.")
def generate_command(target, draft, no_draft, dtype, show_draft, options: GenerateOptions, prompt, use_chat,
                     system, as_json):
    """Generate once from a prompt and print the text (and its stats)."""
    if prompt == "-":
        prompt = sys.stdin.read().rstrip("\n")
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    if system is not None and not use_chat:
        raise click.UsageError("--system needs --chat")
    with _user_errors():
        pair = load_pair(target, draft, wants_draft_model(no_draft, options), dtype)
        if use_chat:
            if not getattr(pair.tokenizer, "chat_template", None):
                raise MlxspecError("this model's tokenizer has no chat template; leave out --chat")
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = pair.encode(msgs)
        else:
            ids = pair.encode(prompt)
        limit = max_context(pair)
        if limit is not None:
            if len(ids) >= limit:
                raise MlxspecError(f"the prompt is {len(ids)} tokens, the model's context window {limit}")
            if len(ids) + options.max_tokens > limit:
                options = options.replace(max_tokens=limit - len(ids))
                click.echo(f"note: the context window leaves room for {options.max_tokens} tokens", err=True)
        s = options.replace(drafter="none") if no_draft or not drafts(options, pair) else options
        session = pair.new_session(s)  # a drafter that cannot run says so here
    stop = StopFlag()
    with stop.armed():
        reply = stream_reply(pair, ids, s, session, None if as_json else sys.stdout, show_draft, stop)
    has_draft = session.drafter is not None
    if as_json:
        st = reply.stats
        doc = {
            "text": reply.text,
            "tokens": reply.tokens,
            "prompt_tokens": len(ids),
            "time_to_first_token": reply.ttft,
            "stats": st.to_dict() if st is not None else None,
            "target": str(pair.target_path),
            "draft": str(pair.draft_path) if has_draft and pair.draft_path else None,
            "drafter": session.drafter.name if has_draft else "none",
            "interrupted": reply.interrupted,
        }
        click.echo(json.dumps(doc, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    _say(stats_line(reply.stats, reply.ttft, has_draft))
