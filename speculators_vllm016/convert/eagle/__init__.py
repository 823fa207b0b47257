"""Converters for EAGLE-family research checkpoints."""

from speculators_vllm016.convert.eagle.eagle_converter import EagleConverter

__all__ = ["EagleConverter"]
