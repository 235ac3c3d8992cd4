"""`mlxspec serve`: an OpenAI-compatible server with speculative decoding.

    command.py       the `serve` command: load the pair, start uvicorn
    app.py           FastAPI routes: read, validate, hand to the worker, stream back
    schema.py        request bodies -> GenerateOptions and token ids; responses, chunks, timings
    worker.py        the one generation thread (MLX), its bounded FIFO queue, cancellation
    prompt_cache.py  an LRU of engine sessions, so a conversation's next turn reuses its caches
    stops.py         stop strings held back across round boundaries
    metrics.py       totals for GET /metrics

Only command.py is imported with the CLI; FastAPI and uvicorn load when the server starts.
"""

from .command import serve_command  # noqa: F401
