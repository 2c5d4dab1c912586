"""The embedded generation engine: a pure-torch Llama/Qwen decoder with a batched, KV-cached sampler.

- :mod:`.model`: :class:`~.model.DecoderLM`, weights under Hugging Face names, prefill and decode steps.
- :mod:`.engine`: :class:`~.engine.EmbeddedEngine`, batched sampling (temperature, top-k, top-p, stops).
- :mod:`.worker`: :class:`~.worker.EmbeddedGenerationWorker`, one replica as a Ray actor.
- :mod:`.generation`: :class:`~.generation.EmbeddedGeneration`, the driver side (``GenerationInterface``).
"""
