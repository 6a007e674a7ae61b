"""Tensor operations of the batched sampler, in plain torch (the same code on CPU and CUDA).

``rng``: counter-based uniforms; ``penalties``: presence / frequency / repetition
penalties; ``truncation``: top-k / top-p / min-p and the inverse-CDF draw.
Each is a handful of elementwise / scan kernels: candidates for one fused
Triton kernel each, tested against these.
"""
