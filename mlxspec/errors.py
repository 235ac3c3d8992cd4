"""Errors a user can act on. The CLI prints them as one line, without a traceback."""


class MlxspecError(Exception):
    """Base class: the message says what went wrong and what to do."""


class ModelNotFoundError(MlxspecError, FileNotFoundError):
    pass


class PairMismatchError(MlxspecError, ValueError):
    """The draft cannot propose tokens for this target (different vocabulary or special tokens)."""


class UnsupportedModelError(MlxspecError, ValueError):
    """An architecture, quantization or cache type mlxspec cannot run."""


class ModelTooLargeError(MlxspecError, MemoryError):
    pass
