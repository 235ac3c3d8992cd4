"""OpenAI's request bodies in, `GenerateOptions` and token ids out; OpenAI's response bodies and
stream chunks back, with llama-server-style `timings` carrying the speculation statistics.

Every way a request can be wrong ends here as an `ApiError`: a 4xx with OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`), never a traceback.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..drafters import NEEDS_DRAFT_MODEL, auto_drafter
from ..options import GenerateOptions

MAX_TOKENS_LIMIT = 1 << 20  # without a known context window, a larger max_tokens is a mistake
MAX_STOPS = 16
MAX_SEED = (1 << 64) - 1


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- requests ---------------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; unknown fields are kept to be checked below
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class Message(_Strict):
    role: str
    content: Union[str, list[ContentPart], None] = None


class _Request(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # mlxspec's own: who drafts and how much (GenerateOptions fields), and llama-server's cache_prompt
    drafter: str | None = None
    num_draft: int | None = None
    num_draft_tokens: int | None = None  # mlx-lm's name for num_draft
    adaptive: bool | None = None
    cache_prompt: bool = True


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str]]


# fields that would change the output in ways mlxspec does not implement: refused unless they
# hold their neutral value, rather than silently ignored
_NEUTRAL = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "suffix": (None, ""),
    "repetition_penalty": (None, 1, 1.0), "response_format": (None, {"type": "text"}),
}


@dataclass
class Served:
    """What the server serves: the pair, its name, the options requests start from."""

    pair: object
    model_id: str
    defaults: GenerateOptions
    context: int | None  # the target's context window, when its config says
    names: frozenset[str] = frozenset()  # other names a request may give in `model`


@dataclass
class Prepared:
    """One validated request, ready for the worker."""

    kind: Literal["chat", "completion"]
    ids: list[int]
    options: GenerateOptions
    stops: list[str]
    stream: bool
    include_usage: bool
    cache_prompt: bool
    warnings: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse_json(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return doc


def prepare(kind: Literal["chat", "completion"], doc: dict, served: Served) -> Prepared:
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        req = model.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"{where}: {err['msg']} (got {_short(err.get('input'))})", param=where,
                       code="invalid_type" if err["type"] != "missing" else "missing_field") from None
    _refuse_unsupported(req)
    if req.model and req.model != served.model_id and req.model not in served.names:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {served.model_id!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")
    if req.n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {req.n}", param="n")
    warnings: list[str] = []
    ids = _encode(kind, req, served)
    options = _options(req, served, len(ids), warnings)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: give at most {MAX_STOPS} non-empty strings", param="stop")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Prepared(kind, ids, options, stops, req.stream, include_usage, req.cache_prompt, warnings)


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_unsupported(req: _Request) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in _NEUTRAL and value not in _NEUTRAL[name]:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def _encode(kind: str, req, served: Served) -> list[int]:
    pair = served.pair
    if kind == "chat":
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                bad = [p.type for p in content if p.type != "text" or p.text is None]
                if bad:
                    raise ApiError(400, f"messages.{i}.content: only text parts are supported, got {bad[0]!r}",
                                   param=f"messages.{i}.content")
                content = "".join(p.text for p in content)
            messages.append({"role": m.role, "content": content or ""})
        if not getattr(pair.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        try:
            ids = pair.encode(messages)
        except Exception as e:  # the template's own checks (roles, order) raise here
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: give one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < pair.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{pair.vocab_size - 1})",
                               param="prompt")
        if not prompt:
            raise ApiError(400, "prompt: the prompt is empty", param="prompt")
        try:
            ids = pair.encode(prompt)
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", param="prompt") from None
    if served.context is not None and len(ids) >= served.context:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context window is {served.context} "
                       "tokens", param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    return ids


def _options(req: _Request, served: Served, prompt_len: int, warnings: list[str]) -> GenerateOptions:
    changes: dict = {}
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        limit = served.context or MAX_TOKENS_LIMIT
        if not 1 <= max_tokens <= limit:
            where = "the context window" if served.context else "the server's limit"
            raise ApiError(400, f"max_tokens must be between 1 and {limit} ({where}), got {max_tokens}",
                           param="max_tokens")
        changes["max_tokens"] = max_tokens
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be between 0 and 2**64-1, got {req.seed}", param="seed")
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "num_draft", "adaptive"):
        if getattr(req, name) is not None:
            changes[name] = getattr(req, name)
    if req.num_draft_tokens is not None and req.num_draft is None:
        changes["num_draft"] = req.num_draft_tokens
    if req.drafter is not None:
        if req.drafter in NEEDS_DRAFT_MODEL and served.pair.draft is None:
            warnings.append(f"drafter {req.drafter!r} needs a draft model and this server has none; "
                            f"the server's default ({served.defaults.drafter!r}) was used")
        else:
            changes["drafter"] = req.drafter
    try:
        options = served.defaults.replace(**changes)
    except ValueError as e:
        param = next((n for n in changes if str(e).startswith(n)), None)
        raise ApiError(400, str(e), param=param) from None
    if served.context is not None and prompt_len + options.max_tokens > served.context:
        room = served.context - prompt_len
        warnings.append(f"the context window leaves room for {room} tokens: max_tokens lowered to {room}")
        options = options.replace(max_tokens=room)
    return options


def drafter_name(pair, options: GenerateOptions) -> str:
    """Who drafts under these options: "model", "lookup", ... or "none"."""
    name = auto_drafter(pair) if options.drafter == "auto" else options.drafter
    return name if options.speculates else "none"


# -- responses --------------------------------------------------------------------------------


def cached_tokens(stats) -> int:
    """Prompt tokens taken from the cache. The prompt's last token is always fed with the first
    round (it produces the first token), so at most prompt_tokens - 1 come from the cache."""
    return max(stats.prompt_tokens - 1 - stats.prefill_tokens, 0)


def usage(stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(stats)},
    }


def timings(stats, drafter: str) -> dict:
    """llama-server's `timings`, plus mlxspec's passes and tokens per pass."""
    prompt_n = stats.prompt_tokens - cached_tokens(stats)
    prompt_ms = stats.prefill_time * 1000
    predicted_ms = stats.decode_time * 1000
    n = stats.generation_tokens
    return {
        "cache_n": cached_tokens(stats),
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / stats.prefill_time if stats.prefill_time > 0 else 0.0,
        "predicted_n": n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / n if n else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "drafter": drafter,
        "passes": stats.rounds,  # target forward passes after the prefill
        "tokens_per_pass": stats.tokens_per_round,
    }


def response(p: Prepared, model: str, text: str, finish: str, stats, drafter: str) -> dict:
    if p.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": _id(p), "object": obj, "created": p.created, "model": model, "choices": [choice],
            "usage": usage(stats), "timings": timings(stats, drafter)}


def chunk(p: Prepared, model: str, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
    if p.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": _id(p), "object": obj, "created": p.created, "model": model, "choices": [choice]}


def usage_chunk(p: Prepared, model: str, stats) -> dict:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    return {"id": _id(p), "object": obj, "created": p.created, "model": model, "choices": [], "usage": usage(stats)}


def _id(p: Prepared) -> str:
    return ("chatcmpl-" if p.kind == "chat" else "cmpl-") + p.id
