"""A small structured logger for the data-generation pipeline (0.3.0's `PipelineLogger`)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["PipelineLogger"]


class PipelineLogger:
    """Sections, key/value blocks and status lines on top of a standard `logging.Logger`."""

    def __init__(self, name: str = "") -> None:
        self.logger = logging.getLogger(name or "speculators")

    def section(self, title: str) -> None:
        self.logger.info("%s\n%s\n%s", "=" * 72, title, "=" * 72)

    def subsection(self, title: str) -> None:
        self.logger.info("-- %s", title)

    def config(self, config_dict: dict[str, Any]) -> None:
        width = max((len(str(key)) for key in config_dict), default=0)
        for key, value in config_dict.items():
            self.logger.info("  %s : %s", str(key).ljust(width), value)

    def info(self, message: str) -> None:
        self.logger.info(message)

    def success(self, message: str) -> None:
        self.logger.info("OK %s", message)

    def warning(self, message: str) -> None:
        self.logger.warning(message)

    def error(self, message: str) -> None:
        self.logger.error(message)

    def debug(self, message: str) -> None:
        self.logger.debug(message)
