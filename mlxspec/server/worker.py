"""The one thread that runs MLX: a bounded FIFO of jobs, served one at a time.

MLX streams belong to a thread, and a generation's rounds must not interleave with another's,
so every engine call happens here. The event loop only hands in a `Job` and reads its events:
`Delta(text)` as rounds are decided, then `Done` (or `Failed`). A full queue is refused at once
(`QueueFull`: the route answers 429 with Retry-After) rather than piling up. Cancelling a job
(its client went away) stops its generation after the current round: closing the engine's
generator leaves the session's caches consistent, and the session goes back to the cache.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from .metrics import Metrics
from .prompt_cache import PromptCache
from .schema import Prepared, cached_tokens, drafter_name
from .stops import StopScanner
from .text import TextStream


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str | None  # "stop", "length", or None when cancelled
    stats: object  # the engine's Stats
    drafter: str


@dataclass
class Failed:
    message: str


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Job:
    request: Prepared
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown)
            self.cancel()


class Worker:
    def __init__(self, pair, prompt_cache_size: int = 4, queue_size: int = 64):
        self.pair = pair
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.cache = PromptCache(pair, prompt_cache_size)
        self.metrics = Metrics()
        self.current: Job | None = None
        self._thread: threading.Thread | None = None
        self._mean_seconds = 1.0  # of recent generations, for Retry-After

    # -- the event loop's side ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.metrics.add(requests_rejected=1)
            wait = self._mean_seconds * (self.jobs.qsize() + 1)
            raise QueueFull(max(1, min(int(wait + 0.999), 600))) from None

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlxspec-generation", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running and waiting jobs and end the thread."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit(Failed("the server is shutting down"))
        if self.current is not None:
            self.current.cancel()
        self.jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the generation thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():  # the client left while it waited
                self.metrics.add(requests_cancelled=1)
                continue
            self.current = job
            tic = time.perf_counter()
            try:
                self._serve(job)
            finally:
                self.current = None
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.perf_counter() - tic)

    def _serve(self, job: Job) -> None:
        req = job.request
        drafter = drafter_name(self.pair, req.options)
        key = (drafter, req.options.ngram_min, req.options.ngram_max)
        stats, finish, session = None, None, None
        try:
            session = self.cache.take(req.ids, req.options, key, reuse=req.cache_prompt)
            # the session was built for this drafter: "auto" lets it draft
            gen = self.pair.stream(req.ids, req.options.replace(drafter="auto"), session=session)
            scan, detok = StopScanner(req.stops), TextStream(self.pair.tokenizer)
            try:
                for chunk in gen:
                    stats = chunk.stats
                    if job.cancelled.is_set():
                        break
                    text, hit = scan.feed(detok.add(chunk.tokens))
                    if not hit and chunk.finish_reason is not None:
                        more, hit = scan.feed(detok.finish())
                        if not hit:
                            rest, hit = scan.finish()
                            more += rest
                        text += more
                    if text:
                        job.emit(Delta(text))
                    if hit:
                        finish = "stop"
                        break
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
                        break
            finally:
                gen.close()  # stops the rounds; the engine leaves the caches consistent
        except Exception as e:  # an engine failure: answer it, log it, drop the session
            traceback.print_exc(file=sys.stderr)
            self.metrics.add(requests_failed=1)
            job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            return
        if req.cache_prompt:
            self.cache.put(key, session)
        self._count(stats, finish is None)
        job.emit(Done(finish, stats, drafter))

    def _count(self, stats, cancelled: bool) -> None:
        if stats is None:
            return
        self.metrics.add(
            requests=1, requests_cancelled=int(cancelled), prompt_tokens=stats.prompt_tokens,
            prompt_tokens_cached=cached_tokens(stats), generation_tokens=stats.generation_tokens,
            draft_tokens=stats.drafted, draft_tokens_accepted=stats.accepted, target_passes=stats.rounds,
            prefill_seconds=stats.prefill_time, decode_seconds=stats.decode_time,
        )
