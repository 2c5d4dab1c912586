"""The embedded generation engine: a pure-torch Llama/Qwen decoder with a batched, KV-cached sampler.

- :mod:`.model`: :class:`~.model.DecoderLM`, weights under Hugging Face names, prefill and decode steps.
- :mod:`.engine`: :class:`~.engine.EmbeddedEngine`, batched sampling (temperature, top-k, top-p, stops).
- :mod:`.replica`: :class:`~.replica.EmbeddedReplica`, one replica (model, engine, seeds), wherever it runs.
- :mod:`.worker`: :class:`~.worker.EmbeddedGenerationWorker`, one replica as a Ray actor of its own.
- :mod:`.generation`: :class:`~.generation.EmbeddedGeneration`, the driver side (``GenerationInterface``).
- :mod:`.in_policy`: :class:`~.in_policy.InPolicyEmbeddedGeneration`, replicas hosted in the DTensor policy
  workers (``policy.generation.embedded_cfg.in_policy_workers``).
"""
