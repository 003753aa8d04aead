"""`maru-shm bench`: one module per scenario, a registry, a runner and a report (see runner.py)."""

from .registry import SCENARIOS, figure
from .runner import build_parser, machine, main

__all__ = ["SCENARIOS", "build_parser", "figure", "machine", "main"]
