"""The vLLM generation backend (GPU only, ``vllm`` extra): vLLM engines behind ``GenerationInterface``.

- :mod:`.convert`: pure conversions between the generation contract and vLLM's objects (engine arguments,
  per-request ``SamplingParams``, ``RequestOutput`` -> output batch, the refit manifest); no vLLM import.
- :mod:`.worker_extension`: :class:`~.worker_extension.VllmWorkerExtension`, methods vLLM mixes into its own
  GPU worker (``LLM(worker_extension_cls=...)``) so refit can load weights with ``LLM.collective_rpc``.
- :mod:`.worker`: :class:`~.worker.VllmGenerationWorker`, one vLLM rank as a Ray actor.
- :mod:`.generation`: :class:`~.generation.VllmGeneration`, the driver side.

Importing this package never imports vLLM; only a worker's constructor does.
"""
