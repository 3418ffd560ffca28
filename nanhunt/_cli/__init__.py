"""The command line: `nanhunt run/demo/show/replay` (`main`), root discovery for unmodified
scripts (`auto`) and the built-in demo (`demo`)."""

from .main import main

__all__ = ["main"]
