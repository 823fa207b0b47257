"""Logging for training: console messages, and metrics to JSONL, TensorBoard, wandb or trackio.

Metrics are logged as mappings on the `speculators.metrics` logger with the step in `extra`:

    logging.getLogger("speculators.metrics").info({"train": {"loss": 0.4}}, extra={"step": 12})

Each backend is a logging handler; TensorBoard, wandb and trackio are imported only when asked
for (none of them is a dependency). The JSONL file is always written by the trainer.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "FormatDictFilter",
    "IsMappingFilter",
    "IsRank0Filter",
    "JsonlHandler",
    "METRICS_FILE",
    "METRICS_LOGGER",
    "NoTrainStepsFilter",
    "TensorBoardHandler",
    "TrackioHandler",
    "WandbHandler",
    "setup_metric_logger",
    "setup_root_logger",
]

METRICS_LOGGER = "speculators.metrics"
# The file name of the JSON-lines metrics log in a training run's save folder; the trainer moves it
# aside for a run from scratch, and evaluation reads tau_sim back from it.
METRICS_FILE = "metrics.jsonl"


def flatten(values: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """`{"train": {"loss": 1}}` -> `{"train/loss": 1}`."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = value
    return flat


def _rank(local: bool) -> int:
    """The rank in the training process group when there is one (with --extraction-ranks it is
    not torchrun's RANK: the training ranks are a world of their own), else torchrun's."""
    if not local:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    variable = "LOCAL_RANK" if local else "RANK"
    return int(os.environ.get(variable, "0"))


def _run_name(run_name: str | None) -> str:
    now = datetime.now()
    name = run_name or "{time}"
    return name.format(
        time=now.strftime("%Y%m%d-%H%M%S"),
        utc_time=datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        rank=_rank(local=False),
        local_rank=_rank(local=True),
    )


class IsMappingFilter(logging.Filter):
    """Passes only records whose message is a mapping (metrics)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return isinstance(record.msg, Mapping)


class IsRank0Filter(logging.Filter):
    """Passes records of rank 0 only (or with `extra={"override_rank0_filter": True}`)."""

    def __init__(self, rank_val: int | None = None, local_rank: bool = False) -> None:
        super().__init__()
        self.rank_val = rank_val
        self.local_rank = local_rank

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "override_rank0_filter", False):
            return True
        rank = self.rank_val if self.rank_val is not None else _rank(self.local_rank)
        return rank == 0


class NoTrainStepsFilter(logging.Filter):
    """Drops the per-step training records (the console's while a progress bar shows them: a
    line per step would break the bar; metrics.jsonl and the backends still get every one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, Mapping) and "train" in record.msg)


class FormatDictFilter(logging.Filter):
    """Renders mapping messages as `key=value, ...` for the console."""

    @staticmethod
    def _format(value: Any) -> str:
        if isinstance(value, float):
            return (
                f"{value:.2e}"
                if value and (abs(value) < 1e-3 or abs(value) > 999)
                else f"{value:.3f}"
            )
        return str(value)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, Mapping):
            record.msg = ", ".join(f"{k}={self._format(v)}" for k, v in flatten(record.msg).items())
            record.args = ()
        return True


class JsonlHandler(logging.Handler):
    """Appends one JSON object per metrics record: `{"step": ..., **metrics}` (the trainer's
    records and their one reader: `train.metrics_log`).

    The file is opened per record, so a resumed run may rewrite it (dropping the lines of lost
    steps) while the handler is attached.
    """

    def __init__(self, path: str | os.PathLike, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, Mapping):
            return
        entry = {"step": getattr(record, "step", None), **record.msg}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, default=float) + "\n")


def _import_backend(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"--logger asks for {package}, which is not installed: pip install {package}"
        ) from error


class TensorBoardHandler(logging.Handler):
    """Writes scalar metrics with `torch.utils.tensorboard` (needs the `tensorboard` package)."""

    def __init__(
        self,
        level: int = logging.INFO,
        run_name: str | None = None,
        log_dir: str | os.PathLike = "logs",
        **tboard_init_kwargs: Any,
    ) -> None:
        super().__init__(level)
        _import_backend("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=str(Path(log_dir) / _run_name(run_name)), **tboard_init_kwargs
        )

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, Mapping):
            return
        step = getattr(record, "step", None)
        for name, value in flatten(record.msg).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        super().close()


class WandbHandler(logging.Handler):
    """Logs metrics to Weights & Biases (needs `wandb`)."""

    package = "wandb"

    def __init__(
        self,
        level: int = logging.INFO,
        run_name: str | None = None,
        log_dir: str | os.PathLike = "logs",
        **init_kwargs: Any,
    ) -> None:
        super().__init__(level)
        self.backend = _import_backend(self.package, self.package)
        self.run = self.backend.init(name=_run_name(run_name), dir=str(log_dir), **init_kwargs)

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, Mapping):
            self.backend.log(flatten(record.msg), step=getattr(record, "step", None))


class TrackioHandler(WandbHandler):
    """Logs metrics to trackio (a wandb-compatible API; needs `trackio`)."""

    package = "trackio"

    def __init__(
        self,
        level: int = logging.INFO,
        run_name: str | None = None,
        log_dir: str | os.PathLike = "logs",
        **init_kwargs: Any,
    ) -> None:
        logging.Handler.__init__(self, level)
        self.backend = _import_backend(self.package, self.package)
        init_kwargs.setdefault("project", "speculators")
        self.run = self.backend.init(name=_run_name(run_name), **init_kwargs)


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a record comes, not as it was at set-up: a caller
    that runs the command in-process (a test, a notebook) may have swapped and closed it since."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_root_logger(
    level: str | int = "INFO", *, ranks: str = "local-0", train_steps: bool = True
) -> None:
    """Console logging, with metric mappings rendered readably. `ranks`: which processes log:
    `local-0` (each node's first process, the default), `rank-0` (rank 0 of the training process
    group: with --extraction-ranks it is not a node's first process) or `every` (an extraction
    rank: each has its own engine and figures). `train_steps=False` keeps the per-step metrics
    off the console (the progress bar shows loss, acc and tokens/s)."""
    if ranks not in ("local-0", "rank-0", "every"):
        raise InvalidInputError(f"ranks must be local-0, rank-0 or every, got {ranks!r}")
    handler = _StderrHandler()
    if ranks != "every":
        handler.addFilter(IsRank0Filter(local_rank=ranks == "local-0"))
    if not train_steps:
        handler.addFilter(NoTrainStepsFilter())
    handler.addFilter(FormatDictFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


_BACKENDS = {"tensorboard": TensorBoardHandler, "wandb": WandbHandler, "trackio": TrackioHandler}


def logger_names(loggers: str | Iterable[str] | None) -> list[str]:
    """The backends a `--logger` value names (comma list or list); `ValueError` for an unknown
    one (checked before the run writes anything, and again when the loggers start)."""
    names = loggers.split(",") if isinstance(loggers, str) else list(loggers or [])
    names = [name.strip() for name in names if name and name.strip()]
    unknown = sorted(set(names) - set(_BACKENDS))
    if unknown:
        raise InvalidInputError(
            f"--logger {', '.join(unknown)}: unknown logger; choose from {', '.join(sorted(_BACKENDS))}"
        )
    return names


def setup_metric_logger(
    loggers: str | Iterable[str] | None,
    run_name: str | None,
    output_dir: str | os.PathLike,
    *,
    jsonl_path: str | os.PathLike | None = None,
) -> list[logging.Handler]:
    """Attach the asked-for backends (comma list or list) to the metrics logger, rank 0 only."""
    names = logger_names(loggers)
    metrics = logging.getLogger(METRICS_LOGGER)
    for handler in list(metrics.handlers):
        metrics.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = []
    if _rank(local=False) == 0:
        if jsonl_path is not None:
            handlers.append(JsonlHandler(jsonl_path))
        handlers.extend(_BACKENDS[name](run_name=run_name, log_dir=output_dir) for name in names)
    for handler in handlers:
        handler.addFilter(IsMappingFilter())
        metrics.addHandler(handler)
    metrics.setLevel(logging.INFO)
    return handlers
