"""Converters for EAGLE-family research checkpoints."""

from speculators_vllm016.convert.eagle.eagle3_converter import Eagle3Converter
from speculators_vllm016.convert.eagle.eagle_converter import EagleConverter

__all__ = ["Eagle3Converter", "EagleConverter"]
