"""Benchmarks: the serving load generator (``bench.serve``, ``dsa-pd bench serve``)
and kernel / transfer micro-benchmarks (the ``bench/*.py`` scripts, run as
``python bench/NAME.py``)."""
