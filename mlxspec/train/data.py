"""Training text for a draft head: files and folders of text and code, JSONL with {"text"} or
{"messages"} (the target's chat template applied), tokenized and cut into samples, with a
held-out split by document.

    docs = read_documents(["src/", "chats.jsonl"])          # [Document(source, text)]
    corpus = build_corpus(docs, tokenizer, max_tokens_per_sample=512, min_tokens=9)
    corpus.train, corpus.held_out                             # lists of token-id lists
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import MlxspecError

# files taken from folders (a file named directly is always read)
TEXT_SUFFIXES = frozenset(
    ".py .pyi .txt .md .rst .c .h .cc .cpp .hpp .rs .go .js .ts .tsx .jsx .java .kt .swift .rb .php .sh "
    ".toml .yaml .yml .cfg .ini .html .css .sql .lua .jl .r .scala .m .mm .tex .json".split()
)
JSONL_SUFFIXES = frozenset({".jsonl"})


class DataError(MlxspecError, ValueError):
    """The training data cannot be used as given."""


@dataclass(frozen=True)
class Document:
    source: str  # "path" or "path:line" for a JSONL record
    text: str | None = None  # plain text
    messages: tuple | None = None  # chat messages, rendered with the chat template


@dataclass(frozen=True)
class Corpus:
    train: list[list[int]]
    held_out: list[list[int]]
    documents: int
    sources: list[str]  # the files read, in order
    data_hash: str  # sha256 over the files' names and bytes
    train_sources: dict[str, int]  # document -> training tokens taken from it
    held_out_sources: dict[str, int]
    vocab_counts: dict[int, int]  # token frequencies over every training document (also beyond max_tokens)

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train)

    @property
    def held_out_tokens(self) -> int:
        return sum(len(s) for s in self.held_out)


def _files(paths: Sequence[str | Path]) -> list[Path]:
    if not paths:
        raise DataError("no training data given (--data FILE_OR_FOLDER ...)")
    out: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES | JSONL_SUFFIXES
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not found:
                raise DataError(f"{path} holds no text, code or .jsonl files")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise DataError(f"no such file or folder: {p}")
    return list(dict.fromkeys(out))


def _jsonl_documents(path: Path, raw: str) -> Iterable[Document]:
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from e
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object with \"text\" or \"messages\", got {type(rec).__name__}")
        if "text" in rec:
            if not isinstance(rec["text"], str):
                raise DataError(f"{where}: \"text\" must be a string")
            yield Document(where, text=rec["text"])
        elif "messages" in rec:
            msgs = rec["messages"]
            if not (isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)):
                raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} strings")
            yield Document(where, messages=tuple((m["role"], m["content"]) for m in msgs))
        else:
            raise DataError(f"{where}: a record needs a \"text\" or a \"messages\" field (it has {sorted(rec)})")


def read_documents(paths: Sequence[str | Path]) -> tuple[list[Document], list[str], str]:
    """(documents, files read, sha256 of the files' names and bytes)."""
    digest = hashlib.sha256()
    docs: list[Document] = []
    files = _files(paths)
    for f in files:
        data = f.read_bytes()
        digest.update(f.name.encode() + b"\0" + data)
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f} is not UTF-8 text (byte {e.start}); give text, code or JSONL files") from e
        if f.suffix.lower() in JSONL_SUFFIXES:
            docs.extend(_jsonl_documents(f, raw))
        elif raw.strip():
            docs.append(Document(str(f), text=raw))
    if not docs or all(not (d.text or "").strip() and not d.messages for d in docs):
        raise DataError(f"the training data is empty ({len(files)} file(s), no text)")
    return docs, [str(f) for f in files], digest.hexdigest()


def encode(doc: Document, tokenizer) -> list[int]:
    if doc.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{doc.source}: chat messages need a tokenizer with a chat template")
        msgs = [{"role": r, "content": c} for r, c in doc.messages]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
        return list(ids)
    return list(tokenizer.encode(doc.text))


def split_samples(ids: list[int], max_tokens: int, min_tokens: int) -> list[list[int]]:
    """Cut one document into pieces of at most max_tokens; a tail shorter than min_tokens is dropped."""
    pieces = [ids[i:i + max_tokens] for i in range(0, len(ids), max_tokens)]
    return [p for p in pieces if len(p) >= min_tokens]


def build_corpus(docs: list[Document], tokenizer, *, max_tokens_per_sample: int, min_tokens: int,
                 held_out_fraction: float = 0.05, max_tokens: int | None = None, seed: int = 0,
                 sources: list[str] | None = None, data_hash: str = "") -> Corpus:
    """Tokenize, hold out whole documents (at least one when there are two or more), and cut
    the rest into samples, shuffled with the seed. max_tokens caps the training tokens (taken
    from the shuffled samples, so a cap keeps a sample of every source, not the first files)."""
    if max_tokens_per_sample < min_tokens:
        raise DataError(f"--max-tokens-per-sample {max_tokens_per_sample} is below the {min_tokens} tokens one "
                        "sample needs for the unroll")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    n_held = max(1, round(held_out_fraction * len(docs))) if held_out_fraction > 0 and len(docs) >= 2 else 0
    held: list[list[int]] = []
    held_sources: dict[str, int] = {}
    for i in order[:n_held]:
        for s in split_samples(encode(docs[i], tokenizer), max_tokens_per_sample, min_tokens):
            held.append(s)
            held_sources[docs[i].source] = held_sources.get(docs[i].source, 0) + len(s)
    pool: list[tuple[list[int], str]] = []
    longest = 0
    counts: dict[int, int] = {}
    for i in sorted(order[n_held:].tolist()):
        ids = encode(docs[i], tokenizer)
        longest = max(longest, len(ids))
        for t in ids:
            counts[t] = counts.get(t, 0) + 1
        pool.extend((s, docs[i].source) for s in split_samples(ids, max_tokens_per_sample, min_tokens))
    if not pool:
        raise DataError(
            f"no training text is long enough: the unroll needs at least {min_tokens} tokens per text, "
            f"the longest training text has {longest}"
        )
    train: list[list[int]] = []
    train_sources: dict[str, int] = {}
    total = 0
    for j in rng.permutation(len(pool)).tolist():
        s, src = pool[j]
        if max_tokens is not None and total + len(s) > max_tokens:
            s = s[: max_tokens - total]
            if len(s) < min_tokens:
                break
        train.append(s)
        train_sources[src] = train_sources.get(src, 0) + len(s)
        total += len(s)
    return Corpus(train, held, len(docs), sources or [], data_hash, train_sources, held_sources, counts)
