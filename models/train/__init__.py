"""Training of the small DeepSeek-V3.2 model the project ships (docs/training.md).

``sources`` (Debian text packages -> documents), ``corpus`` (documents,
held-out split, token files: ``python -m models.train.corpus``), ``tokenizer``
(byte-level BPE with a chat template), ``arch`` (the architectures),
``dsa`` (the training forward: dense / sparse attention, indexer KL, MoE,
MTP), ``train`` (the time-boxed, resumable loop: ``python -m
models.train.train``), ``export`` (Hugging Face checkpoint with the MTP
shard; packing for a device call), ``plot`` (loss curves).
"""
