"""`mlxspec serve`: load the pair once, then serve it over OpenAI's API with uvicorn.

The flags of `mlxspec chat` choose the models; the generation flags are the defaults a request
starts from (a request's own fields override them).
"""

from __future__ import annotations

import os

import click

from ..chat import _model_options, _user_errors, load_pair, max_context, wants_draft_model
from ..cli_options import generation_options
from ..errors import MlxspecError
from ..options import GenerateOptions

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _model_flags(f):
    """chat's model flags, less --show-draft (no terminal to colour)."""
    f = _model_options(f)
    f.__click_params__ = [p for p in f.__click_params__ if p.name != "show_draft"]
    return f


@click.command("serve")
@_model_flags
@generation_options(max_tokens=512)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. 0.0.0.0 lets other machines in: set --api-key.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", envvar="MLXSPEC_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on every endpoint but /health (or set MLXSPEC_API_KEY).")
@click.option("--prompt-cache-size", type=click.IntRange(min=0), default=4, show_default=True,
              help="Conversations whose KV caches are kept for the next request (0: none). Each holds its "
                   "tokens' KV cache, target and draft.")
@click.option("--queue-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests that may wait; more are answered 429 with Retry-After.")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001), default=8.0, show_default=True,
              help="Largest request body.")
@click.option("--model-name", default=None, help="The model id in /v1/models and responses. Default: the pair's name.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
def serve_command(target, draft, no_draft, dtype, options: GenerateOptions, host, port, api_key,
                  prompt_cache_size, queue_size, max_body_mb, model_name, log_level):
    """Serve a model over an OpenAI-compatible API, speculative decoding on.

    POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models, /health
    and /metrics. Every response carries `timings` (prompt and cached tokens, tokens/s,
    draft_n, draft_n_accepted, tokens_per_pass). Requests may set drafter, num_draft and
    adaptive; a conversation's next turn reuses its KV cache.
    """
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise click.ClickException(f"mlxspec serve needs FastAPI and uvicorn ({e}): pip install 'mlxspec[serve]'")
    from .schema import Served
    from .worker import Worker

    if no_draft:
        options = options.replace(drafter="none")
    with _user_errors():
        pair = load_pair(target, draft, wants_draft_model(no_draft, options), dtype)
        pair.new_session(options)  # a default drafter that cannot run says so now, not per request
        if pair.tokenizer is None:
            raise MlxspecError("the model has no tokenizer; the server needs one")
    names = {str(pair.target_path), pair.target_path.name}
    if target:
        names.add(target)
    served = Served(pair, model_name or pair.label, options, max_context(pair), frozenset(names))
    worker = Worker(pair, prompt_cache_size, queue_size)
    app = create_app(served, worker, api_key or None, int(max_body_mb * (1 << 20)))
    if host not in LOCAL_HOSTS:
        click.secho(f"warning: listening on {host}: anyone who can reach this machine can use the model"
                    + ("" if api_key else "; set --api-key"), fg="yellow", err=True)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"Serving {served.model_id} at http://{shown}:{port}/v1 "
               f"(drafter {options.drafter}, prompt cache {prompt_cache_size}, pid {os.getpid()})", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
