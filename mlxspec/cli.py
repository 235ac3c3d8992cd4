"""The `mlxspec` command line: it only parses options and calls the Python API.

Each command lives in the module that implements it (`convert.py`, `chat.py`, `bench.py`);
this file gathers them into one Click group.
"""

from __future__ import annotations

import click

from . import __version__
from .platform import maybe_reexec_with_openblas


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxspec")
def cli() -> None:
    """Exact speculative decoding for local LLMs with MLX."""


def _register() -> None:
    import importlib

    for module, name in [
        ("convert", "convert_command"),
        ("chat", "chat_command"),
        ("chat", "generate_command"),
        ("bench", "bench_command"),
        ("train.command", "train_drafter_command"),
        ("server", "serve_command"),
    ]:
        try:
            mod = importlib.import_module(f".{module}", __package__)
        except ModuleNotFoundError as e:  # a command not built yet
            if e.name and e.name.startswith(__package__):
                continue
            raise
        cmd = getattr(mod, name, None)
        if cmd is not None:
            cli.add_command(cmd)


_register()


def main() -> None:
    maybe_reexec_with_openblas()
    cli(prog_name="mlxspec")


if __name__ == "__main__":
    main()
