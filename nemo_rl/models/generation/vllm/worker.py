"""One vLLM rank, run as a Ray actor by :class:`~nemo_rl.distributed.worker_groups.RayWorkerGroup`.

Each actor owns the GPU of its bundle and builds a ``vllm.LLM`` in its own process (vLLM's engine core and
GPU worker included: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). With ``vllm_cfg.tensor_parallel_size > 1`` the
actors of one data-parallel group are the ranks of one tensor-parallel engine: they join a torch.distributed
world from the worker group's ``RANK`` / ``WORLD_SIZE`` (laid out (dp, tp) row-major, as vLLM's external
launcher expects), receive the same prompts and seeds, and sample the same tokens.

vLLM is imported in the constructor only, so this module imports on machines without vLLM.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import (
    configure_worker_threads,
    cuda_available,
    get_device,
    init_process_group_from_env,
)
from nemo_rl.models.generation.in_flight import InFlightWeights
from nemo_rl.models.generation.interfaces import (
    WeightManifestDict,
    check_generation_input,
    empty_generation_output,
)
from nemo_rl.models.generation.lora import AdapterLayout, base_manifest_for, refuse_after_draining
from nemo_rl.models.generation.vllm.convert import (
    RELOAD_WEIGHTS_RPC,
    RETRIED_FINISH_REASONS,
    WEIGHT_CHECKSUMS_RPC,
    assemble_outputs,
    generation_budgets,
    hf_weights_manifest,
    prompt_token_ids,
    request_seeds,
    rows_to_retry,
    sampling_params_for_rows,
)
from nemo_rl.models.generation.vllm.cpu_shm import CpuShmSegments, prepare_cpu_shm
from nemo_rl.models.generation.vllm.engine_setup import (
    check_engine_arg_names,
    check_vllm_config,
    engine_arg_names,
    engine_kwargs,
    max_sequence_length,
    worker_env,
)
from nemo_rl.models.generation.vllm.images import patch_layout, vllm_prompts
from nemo_rl.models.generation.vllm.lora import VllmAdapters, lora_engine_kwargs, split_adapters
from nemo_rl.models.generation.vllm.tmp_dir import temporary_files_in, worker_tmp_dir
from nemo_rl.models.generation.vllm.worker_extension import keep_cpu_linear_weights_in_place
from nemo_rl.models.hf_config import load_hf_config
from nemo_rl.models.hf_moe import per_expert_weights
from nemo_rl.models.tokenizer import eos_token_ids, require_pad_token_id
from nemo_rl.weight_sync.checksums import Checksum
from nemo_rl.weight_sync.interfaces import TransferStats, WeightReceiver
from nemo_rl.weight_sync.manifest import WeightManifest, dtype_from_name
from nemo_rl.weight_sync.scope import RefitScope

logger = logging.getLogger(__name__)

# vLLM's memory pools, as named by `LLM.sleep` / `LLM.wake_up(tags=...)`.
WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"

# How often a row whose request vLLM finished with "error" or "abort" is sent again before the call fails.
# vLLM documents "error" as retryable (e.g. a failed KV-cache load); a seeded request replays the same tokens.
MAX_REQUEST_RETRIES = 2


class VllmGenerationWorker:
    """A Ray actor holding one rank of a vLLM engine.

    Args:
        cfg: the ``policy`` section (model, sampling settings, ``generation.vllm_cfg``, sequence limits).
        tokenizer: the policy's tokenizer, for the pad and EOS ids.
        seed: the engine seed, equal on every rank (tensor-parallel ranks must sample alike).
        vllm_ports: ``VLLM_PORT`` of every worker of the group, by rank (see ``engine_setup.engine_ports``).
        model_path: a local Hugging Face checkpoint folder overriding ``cfg.model_name``.
    """

    def __init__(
        self,
        cfg: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int,
        vllm_ports: Sequence[int],
        model_path: str | None = None,
    ) -> None:
        configure_worker_threads()
        check_vllm_config(cfg)
        self.rank = int(os.environ.get("RANK", "0"))
        self.vllm_port = int(vllm_ports[self.rank])
        self.pad_token_id = require_pad_token_id(tokenizer)
        self.cfg = cfg
        self.dp_rank = int(os.environ.get("NEMO_RL_DP_RANK", "0"))
        self.colocated = cfg.generation.colocated.enabled
        self.max_sequence_length = max_sequence_length(cfg)
        self.model_source = model_path or cfg.model_name
        local_dir = Path(self.model_source).expanduser()
        self.stop_token_ids = sorted(
            {
                *eos_token_ids(tokenizer, local_dir if local_dir.is_dir() else None),
                *(cfg.generation.stop_token_ids or []),
            }
        )
        hf_config = load_hf_config(
            self.model_source, trust_remote_code=cfg.trust_remote_code, overrides=cfg.hf_config_overrides
        )
        self._dtype = dtype_from_name(cfg.generation.vllm_cfg.precision)
        # A vision-language model's prompts carry the processor's patches, turned back into pictures for vLLM.
        self._patch_layout = patch_layout(
            hf_config, cfg.tokenizer.name or self.model_source, cfg.trust_remote_code
        )
        self._manifest = hf_weights_manifest(hf_config, self._dtype, trust_remote_code=cfg.trust_remote_code)
        self._adapters = self._lora_adapters(cfg)
        # Whether vLLM's encoder cache record must be reset before the next call (after a weight update, see _load).
        self._encoder_cache_stale = False
        # Pools (vLLM sleep-mode tags) currently released; the engine starts awake.
        self._asleep: set[str] = set()
        # Whether finish_generation puts the engine to sleep: colocated, on a platform with sleep mode
        # (vLLM's CPU platform has none; its engine stays resident next to the policy). Set by _start_engine.
        self._sleeps = False
        self._sampling_params_cls: Any = None
        # A CPU tensor-parallel engine's shared-memory segments, removed at shutdown (see .cpu_shm).
        self._cpu_shm: CpuShmSegments | None = None
        self.llm: Any = self._start_engine(seed)
        # Asynchronous GRPO's in-flight updates: off until enable_in_flight_weight_updates.
        self._in_flight: InFlightWeights | None = None
        logger.info(
            "vLLM generation rank %d (dp rank %d): %s in %s, tensor parallel %d",
            self.rank,
            self.dp_rank,
            self.model_source,
            cfg.generation.vllm_cfg.precision,
            cfg.generation.vllm_cfg.tensor_parallel_size,
        )

    def _lora_adapters(self, cfg: PolicyConfig) -> VllmAdapters | None:
        """With LoRA, the adapters refits install as vLLM's own adapter (:mod:`.lora`); else None."""
        layout = AdapterLayout.from_policy_config(cfg, self._manifest, cfg.generation.vllm_cfg.precision)
        if layout is None:
            return None
        if self.rank == 0:
            logger.info(
                "LoRA refits into vLLM use vLLM's own LoRA support (enable_lora, one adapter of rank <= %d "
                "reloaded in place): after the first refit only the adapters move",
                lora_engine_kwargs(cfg)["max_lora_rank"],
            )
        return VllmAdapters(cfg, layout, self._manifest, str(self.model_source))

    def _start_engine(self, seed: int) -> Any:
        """Build the ``vllm.LLM`` (and remember vLLM's ``SamplingParams`` class)."""
        # Before vLLM is imported: it reads some of these once.
        os.environ.update(worker_env(self.cfg, self.vllm_port))
        # The engine's ZeroMQ sockets and file store go in a folder of this worker's (see tmp_dir): vLLM leaves
        # them in /tmp under random names when its engine process is ended.
        self._rpc_dir: str | None = worker_tmp_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        tp_size = self.cfg.generation.vllm_cfg.tensor_parallel_size
        if tp_size > 1:
            # vLLM's external launcher picks its GPU by LOCAL_RANK; Ray shows this actor only its own GPU. A
            # CPU engine's ranks are numbered within the engine.
            os.environ["LOCAL_RANK"] = str(get_device().index if cuda_available() else self.rank % tp_size)
            init_process_group_from_env()
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        self._sampling_params_cls = vllm.SamplingParams
        check_engine_arg_names(self.cfg.generation.vllm_kwargs, engine_arg_names(EngineArgs, vllm.LLM))
        cpu = current_platform.is_cpu()
        self._sleeps = self.colocated and not cpu
        if cpu:
            keep_cpu_linear_weights_in_place()
        if cpu and tp_size > 1:
            self._cpu_shm = prepare_cpu_shm()
        tokenizer_source = self.cfg.tokenizer.name or self.model_source
        with temporary_files_in(self._rpc_dir):
            return vllm.LLM(
                **engine_kwargs(
                    self.cfg, model=self.model_source, tokenizer=tokenizer_source, seed=seed, cpu=cpu
                )
            )

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, data: BatchedDataDict[Any], greedy: bool, seed: int) -> BatchedDataDict[Any]:
        """Generate for this replica's shard (see ``GenerationInterface.generate``); ``seed`` is the driver's
        per-call seed. vLLM batches the whole shard itself (``policy.generation_batch_size`` does not apply)."""
        if data.size == 0:
            return empty_generation_output(data)
        check_generation_input(data)
        # A sleeping vLLM engine keeps its scheduler paused until every pool is back: requests sent to it
        # would wait forever, so a caller that skipped prepare_for_generation gets the engine woken.
        self._wake({WEIGHTS_TAG, KV_CACHE_TAG})
        if self._encoder_cache_stale:
            self.llm.llm_engine.reset_encoder_cache()
            self._encoder_cache_stale = False
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        params = sampling_params_for_rows(
            self._sampling_params_cls,
            self.cfg.generation,
            budgets=generation_budgets(input_lengths, self.cfg.max_new_tokens, self.max_sequence_length),
            stop_strings=data.get("stop_strings"),
            stop_token_ids=self.stop_token_ids,
            greedy=greedy,
            seeds=request_seeds(seed, self.dp_rank, data.size),
        )
        requests = vllm_prompts(
            prompt_token_ids(input_ids, input_lengths),
            data.get("pixel_values"),
            data.get("image_grid_thw"),
            self._patch_layout,
        )
        # Rows whose prompt already fills the sequence limit get no request (vLLM needs max_tokens >= 1).
        pending = [row for row, row_params in enumerate(params) if row_params is not None]
        completions: list[Any] = [None] * data.size
        for attempt in range(MAX_REQUEST_RETRIES + 1):
            if not pending:
                break
            if attempt:
                logger.warning(
                    "vLLM finished %d requests with %s; sending them again (retry %d of %d)",
                    len(pending),
                    RETRIED_FINISH_REASONS,
                    attempt,
                    MAX_REQUEST_RETRIES,
                )
            outputs = self._run_requests([requests[row] for row in pending], [params[row] for row in pending])
            if len(outputs) != len(pending):
                raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(pending)} prompts")
            finished = [output.outputs[0] for output in outputs]
            for row, completion in zip(pending, finished, strict=True):
                completions[row] = completion
            pending = [pending[i] for i in rows_to_retry(finished)]
        # Rows still failing after the retries make assemble_outputs raise, naming the finish reason.
        return assemble_outputs(input_ids, input_lengths, completions, self.pad_token_id)

    def _run_requests(self, prompts: list[dict[str, Any]], params: list[Any]) -> list[Any]:
        """vLLM's outputs for ``prompts``, in order. With in-flight updates the engine is stepped here (as
        ``LLM.generate`` does) so that weights a refit staged meanwhile are loaded between two steps."""
        if self._in_flight is None:
            return list(self.llm.generate(prompts, params, use_tqdm=False, **self._lora_kwargs()))
        with self._in_flight.generating():
            self.llm.enqueue(prompts, params, use_tqdm=False, **self._lora_kwargs())
            engine = self.llm.llm_engine
            finished: list[Any] = []
            while engine.has_unfinished_requests():
                if self._in_flight.has_pending:
                    self._in_flight.apply_pending()
                finished.extend(output for output in engine.step() if output.finished)
        return sorted(finished, key=lambda output: int(output.request_id))

    def _lora_kwargs(self) -> dict[str, Any]:
        """The policy's adapter for every request (none without LoRA: the calls stay as they were)."""
        return {} if self._adapters is None else {"lora_request": self._adapters.request}

    def enable_in_flight_weight_updates(self, recompute_kv_cache: bool) -> None:
        """Let refits (run in a second thread of this actor) reach the engine while it generates: their
        weights are staged and loaded between two engine steps. The running requests keep the keys and values
        computed so far: recomputing them is built for the embedded engine only."""
        if recompute_kv_cache:
            raise ValueError(
                "grpo.async_grpo.recompute_kv_cache_after_weight_updates is built for the embedded engine: with "
                "vLLM set it false"
            )
        if self._patch_layout is not None:
            # vLLM's reload empties its encoder cache under requests the scheduler still counts on it for.
            raise ValueError(
                "in-flight weight updates of a vision-language model are built for the embedded engine: with vLLM "
                "set grpo.async_grpo.in_flight_weight_updates=false"
            )
        self._in_flight = InFlightWeights(self._load)

    def in_flight_updates(self) -> int:
        """Weight updates loaded between two engine steps so far."""
        return 0 if self._in_flight is None else self._in_flight.updates_between_steps

    def in_flight_generating(self) -> bool:
        """Whether a generation call runs with in-flight updates on (a refit sent now is staged for it)."""
        return self._in_flight is not None and self._in_flight.generating_now

    def _wake(self, tags: set[str]) -> None:
        """Bring back the released pools among ``tags`` (vLLM warns and does nothing for awake ones)."""
        sleeping = sorted(self._asleep & tags)
        if sleeping:
            self.llm.wake_up(tags=sleeping)
            self._asleep.difference_update(sleeping)

    def prepare_for_generation(self) -> None:
        """Bring the weights and the KV cache back onto the GPU after :meth:`finish_generation`."""
        self._wake({WEIGHTS_TAG, KV_CACHE_TAG})

    def finish_generation(self) -> None:
        """Colocated on a GPU: hand the GPU to the policy (weights offloaded to host memory, KV cache
        dropped). A non-colocated engine keeps its GPU; a CPU engine (no sleep mode) stays resident."""
        if self._sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {WEIGHTS_TAG, KV_CACHE_TAG}

    # ------------------------------------------------------------------------------- refit receiver
    def expected_weights_manifest(self, scope: RefitScope = "full") -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` of every weight a refit of ``scope`` must deliver (with LoRA
        the adapters too, see :mod:`.lora`)."""
        layout = None if self._adapters is None else self._adapters.layout
        return base_manifest_for(layout, self._manifest, scope)

    def load_hf_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a stream of Hugging Face-named full tensors into the engine (the refit ``LoadFn``)."""
        self._load(named_tensors)

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        # Loading writes into the weight pool, so it must be mapped; the KV cache may stay released.
        self._wake({WEIGHTS_TAG})
        adapters: dict[str, torch.Tensor] = {}
        stream = (
            split_adapters(named_tensors, adapters) if self._adapters is not None else iter(named_tensors)
        )
        first = next(stream, None)
        num_bytes = 0
        if first is not None:  # an adapters-only refit reloads no base weight
            stream = itertools.chain([first], stream)
            num_bytes = sum(self.llm.collective_rpc(RELOAD_WEIGHTS_RPC, args=(stream,)))
        if adapters and self._adapters is not None:
            self._adapters.install(self.llm, adapters)
            num_bytes += sum(t.numel() * t.element_size() for t in adapters.values())
        # Cached prefixes hold keys and values computed with the old weights. vLLM's reload also empties the
        # model runner's cache of image features but not the scheduler's record of it, so the next request
        # with a picture seen before would fail ("Encoder cache miss"): the record is dropped before the next
        # call (not now: a reload between two engine steps has requests running).
        self.llm.reset_prefix_cache()
        self._encoder_cache_stale = self._patch_layout is not None
        return int(num_bytes)

    def load_weights_from_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a full set of weights (each expected weight exactly once); return the bytes loaded."""
        tensors = list(per_expert_weights(named_tensors))
        # Floating-point tensors are compared in the engine's dtype: loading casts them.
        problems = WeightManifest.coerce(self._manifest).differences(
            WeightManifest.from_named_tensors(tensors, dtype=self._dtype)
        )
        if problems:
            raise ValueError("the weight update does not fit the vLLM model: " + "; ".join(problems))
        if self._adapters is not None:  # plain weights (e.g. a merged checkpoint): no adapter on top
            self._adapters.drop()
        if self._in_flight is not None:
            self._in_flight.receive(tensors)
            return sum(t.numel() * t.element_size() for _, t in tensors)
        return self._load(tensors)

    def refit_receive(self, receiver: WeightReceiver, scope: RefitScope = "full") -> TransferStats:
        """The generation side of a refit of ``scope``: receive, check and load the weights
        (``nemo_rl.weight_sync``); with in-flight updates on, weights arriving during a generation call are
        loaded between two steps. With LoRA the adapters are installed as vLLM's adapter (:mod:`.lora`)."""
        load = self.load_hf_weights if self._in_flight is None else self._in_flight.receive
        if self._adapters is not None and self._adapters.refuses(scope):
            load = functools.partial(refuse_after_draining, engine="a vLLM engine")
        stats = receiver.receive(load, self.expected_weights_manifest(scope))
        if self._adapters is not None and scope == "full":
            self._adapters.holds_base = True
        return stats

    def weight_checksums(self) -> dict[str, Checksum] | None:
        """The refit guard's checksums of this rank's parameters under vLLM's names (its slice of each
        tensor-parallel one); ``None`` with in-flight updates on (a refit may still be staged) or for a
        quantised model (its parameters hold other values than those sent)."""
        if self._in_flight is not None:
            return None
        self._wake({WEIGHTS_TAG})
        report: dict[str, Checksum] | None = self.llm.collective_rpc(WEIGHT_CHECKSUMS_RPC)[0]
        return report

    def shutdown(self) -> None:
        """Drop the engine, free its GPU memory and remove a CPU engine's shared-memory segments."""
        del self.llm
        if self._cpu_shm is not None:
            self._cpu_shm.remove()
        if self._adapters is not None:
            self._adapters.close()
        gc.collect()
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
        if cuda_available():
            torch.cuda.empty_cache()
