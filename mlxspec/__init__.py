"""mlxspec: exact speculative decoding for local LLMs with MLX.

    import mlxspec
    pair = mlxspec.load("path/to/target", draft="path/to/draft", dtype="float32")
    res = pair.generate("def fib(n):", max_tokens=128, num_draft=4)
    print(res.text, res.stats.acceptance_rate, res.stats.tokens_per_second)
"""

__version__ = "0.1.0"

# first: MLX_ENABLE_TF32=0 before MLX runs a matmul (float32 stays float32 on CUDA; platform.py)
from . import platform as _platform  # noqa: E402, F401
from .engine import Chunk, GenerationResult, Pair, Session, Stats  # noqa: E402
from .errors import (  # noqa: E402
    MlxspecError,
    ModelNotFoundError,
    ModelTooLargeError,
    PairMismatchError,
    UnsupportedModelError,
)
from .loading import load  # noqa: E402
from .options import GenerateOptions  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = [
    "__version__",
    "load",
    "Pair",
    "Session",
    "Stats",
    "Chunk",
    "GenerationResult",
    "SamplingParams",
    "GenerateOptions",
    "MlxspecError",
    "ModelNotFoundError",
    "ModelTooLargeError",
    "PairMismatchError",
    "UnsupportedModelError",
]
