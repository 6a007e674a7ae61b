"""``dsa-pd bench soak``: a bounded soak of a running server (issue 23): concurrent streaming clients
with a mix of lengths, cancellations and bad requests for a fixed time; then zero unexpected errors,
every page pool back at its start count, and every replica's resident memory flat after the warm-up.
docs/reliability.md records a 10-minute run."""

from bench.soak.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
