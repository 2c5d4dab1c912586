"""Metric backends behind one protocol; :class:`nemo_rl.utils.logger.Logger` fans out to the enabled ones.

The heavy backends (W&B, SwanLab, MLflow, TensorBoard) import their library only when constructed.
"""

from nemo_rl.utils.loggers.base import LoggerBackend, flatten_params, prefixed, require_package
from nemo_rl.utils.loggers.console import Console, ConsoleMode
from nemo_rl.utils.loggers.jsonl import METRICS_FILE, JsonlBackend

__all__ = [
    "METRICS_FILE",
    "Console",
    "ConsoleMode",
    "JsonlBackend",
    "LoggerBackend",
    "flatten_params",
    "prefixed",
    "require_package",
]
