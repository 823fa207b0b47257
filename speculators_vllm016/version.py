"""The package version, read from the installed distribution."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("speculators-vllm016")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
