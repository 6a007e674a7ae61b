"""The side-by-side harness: dsa-pd and a peer engine (vLLM 0.26.0) on the same checkpoint, GPU and load."""
