"""Sampling on the device, for a whole batch at once.

``params``: `SamplingParams` (what a request asks); ``metadata``: the batch's
parameters and token history as device tensors; ``sampler``: `sample` (one
token per row); ``rejection``: `accept` (MTP draft acceptance); ``output``:
the results, packed for the step's one read-back; ``ops/``: the tensor
operations (counter-based uniforms, penalties, truncation and the draw).
"""
