"""``dsa-pd bench serve``: an async load generator for any OpenAI-compatible
server (dsa-pd's, vLLM's, ...), with the flags of ``vllm bench serve``.

Modules, one job each: ``datasets`` (the requests), ``arrivals`` (when they
are sent), ``client`` (one streamed request, timed per chunk), ``loadgen``
(rate and concurrency), ``metrics`` (per-request records, statistics),
``report`` (table and JSON), ``cli`` (arguments and the run). Usage and the
meaning of every number: docs/benchmarking.md.
"""

from bench.serve.cli import add_arguments, main, run, run_benchmark

__all__ = ["add_arguments", "main", "run", "run_benchmark"]
