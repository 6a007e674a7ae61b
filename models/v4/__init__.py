"""DeepSeek-V4 (``model_type: deepseek_v4``) on the reference backend: config (``config``),
attention with compressors, indexer and sinks (``attention``), hyper-connections and RoPE
(``layers``), MoE (``moe``), per-sequence state (``state``), cache groups (``cache_spec``),
the model (``model``) and checkpoint loading (``loader``). Registered in ``models.registry``."""
