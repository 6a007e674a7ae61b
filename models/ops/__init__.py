"""Model compute ops with two implementations behind one signature:
``*_ref`` (plain torch, runs anywhere: the spec the tests use) and ``*_cuda``
(Triton kernels on a CUDA device), tested against each other."""
