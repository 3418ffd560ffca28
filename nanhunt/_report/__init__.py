"""Reports and renderers: plain data in (findings, history), text/HTML/JSON out."""

from .render import print_report
from .report import Report

__all__ = ["Report", "print_report"]
