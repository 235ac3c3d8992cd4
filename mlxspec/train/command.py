"""`mlxspec train-drafter`: parses options and calls train/pipeline.py's train_drafter."""

from __future__ import annotations

import click

from ..errors import MlxspecError
from .pipeline import TrainSettings


@click.command("train-drafter")
@click.option("--target", "-t", required=True, help="Target model folder (or pair folder: its target).")
@click.option("--data", "data", required=True, multiple=True,
              help="Text/code files or folders, or .jsonl with {\"text\"} or {\"messages\"} records (repeatable).")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Output folder (the head).")
@click.option("--draft-vocab", default=16384, show_default=True, type=click.IntRange(2),
              help="Draft vocabulary: the most frequent tokens of the data (fewer if fewer occur).")
@click.option("--ttt-steps", default=5, show_default=True, type=click.IntRange(1),
              help="Unrolled steps of training-time test (the head fed its own outputs).")
@click.option("--epochs", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--steps", default=None, type=click.IntRange(1), help="Optimizer steps (overrides --epochs).")
@click.option("--batch-size", default=2, show_default=True, type=click.IntRange(1), help="Samples per step.")
@click.option("--max-tokens-per-sample", default=512, show_default=True, type=click.IntRange(2))
@click.option("--max-tokens", default=None, type=click.IntRange(1), help="Cap on training tokens (a seeded sample).")
@click.option("--held-out", "held_out", default=0.05, show_default=True, type=click.FloatRange(0, 0.5),
              help="Fraction of documents held out for evaluation.")
@click.option("--lr", default=3e-4, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--warmup", default=0.05, show_default=True, type=click.FloatRange(0),
              help="Warm-up: a fraction of the steps, or a step count when >= 1.")
@click.option("--clip", default=0.5, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--weight-decay", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--intermediate-size", default=None, type=click.IntRange(1),
              help="The head's MLP width (default: the target's; smaller trains faster).")
@click.option("--taps", default=None, help="Tapped target layers, e.g. 1,13,24 (default: EAGLE-3's low/mid/high).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--checkpoint-every", default=100, show_default=True, type=click.IntRange(1))
@click.option("--eval-prompts", default=4, show_default=True, type=click.IntRange(0),
              help="Held-out prompts whose target-greedy continuations measure acceptance.")
@click.option("--eval-new-tokens", default=48, show_default=True, type=click.IntRange(2))
@click.option("--engine-eval/--no-engine-eval", default=True, show_default=True,
              help="At the end, generate from the held-out prompts through the real engine (decodes with the target).")
@click.option("--features", "features_dir", default=None, type=click.Path(file_okay=False),
              help="Feature cache folder (default OUT/features).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Load the target in this dtype.")
@click.option("--resume", is_flag=True, help="Continue OUT's last checkpoint (same settings and data).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def train_drafter_command(target, data, out, draft_vocab, ttt_steps, epochs, steps, batch_size, max_tokens_per_sample,
                          max_tokens, held_out, lr, warmup, clip, weight_decay, intermediate_size, taps, seed,
                          checkpoint_every, eval_prompts, eval_new_tokens, engine_eval, features_dir, dtype, resume, quiet):
    """Train an EAGLE-3 draft head for TARGET on your own text or code, with MLX.

    Writes OUT as a head folder (config.json + model.safetensors, the published EAGLE-3 layout)
    that `mlxspec.load(TARGET, draft=OUT)` reads, with mlxspec-train.json (provenance),
    train-log.jsonl, loss.png, checkpoints/ and the cached target features.
    """
    from .pipeline import train_drafter

    try:
        tap_layers = tuple(int(x) for x in taps.split(",")) if taps else None
    except ValueError:
        raise click.BadParameter(f"--taps must be comma-separated layer numbers, got {taps!r}")
    settings = TrainSettings(
        draft_vocab=draft_vocab, ttt_steps=ttt_steps, epochs=epochs, steps=steps, batch_size=batch_size,
        max_tokens_per_sample=max_tokens_per_sample, max_tokens=max_tokens, held_out_fraction=held_out, lr=lr,
        warmup=warmup, clip=clip, weight_decay=weight_decay, intermediate_size=intermediate_size,
        tap_layers=tap_layers, seed=seed, checkpoint_every=checkpoint_every, eval_prompts=eval_prompts,
        eval_new_tokens=eval_new_tokens, engine_eval=engine_eval, dtype=dtype,
    )
    try:
        p = train_drafter(target, list(data), out, settings, resume=resume, features_dir=features_dir,
                          progress=not quiet, echo=click.echo)
    except MlxspecError as e:
        raise click.ClickException(str(e))
    except KeyboardInterrupt:
        click.echo(f"interrupted; {out} keeps its last checkpoint (continue with --resume)", err=True)
        raise SystemExit(130)
    ev = p.get("eval") or {}
    click.echo(f"done: {p['step']} steps, {p['data']['train_tokens']} tokens; held-out acceptance per position "
               f"{ev.get('acceptance_per_position')}, {ev.get('tokens_per_pass')} tokens/pass -> {out}")
