"""Training EAGLE-3 draft heads for mlx-lm targets with MLX (`mlxspec train-drafter`).

data.py (text, code, JSONL -> samples), features.py (target taps and distributions, cached),
vocab.py (the draft vocabulary), loop.py (the TTT unroll and the resumable loop),
evaluate.py (acceptance, the loss curve), pipeline.py (train_drafter), command.py (the CLI).
"""

from .pipeline import TrainSettings, train_drafter

__all__ = ["TrainSettings", "train_drafter"]
