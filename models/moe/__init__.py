"""Mixture of experts: noaux_tc routing (``router``), this rank's routed
experts as stacked weights (``experts``), the contiguous and masked
layouts (``dispatch``) and the layer (``layer``); the grouped GEMMs live in
``models/ops/grouped_gemm_{ref,cuda}.py``."""
