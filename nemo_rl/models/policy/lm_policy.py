"""The driver-side policy: one object that runs a sharded language model on a group of Ray workers.

``Policy`` picks the worker backend from the config (DTensor or Megatron, :func:`_worker_backend`; both
implement :class:`~nemo_rl.models.policy.worker_base.PolicyWorkerBase`), starts one worker per bundle and
implements :class:`~nemo_rl.models.policy.interfaces.PolicyInterface` by sharding batches over the
data-parallel groups, calling every worker (the calls are collectives) and merging the dp leaders' results.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.single_process import LocalCluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_group_facade import WorkerGroupFacade, start_worker_group
from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker
from nemo_rl.models.policy.hf_io import check_model_settings
from nemo_rl.models.policy.interfaces import LoraSummary, TrainResult, nonfinite_step_flags
from nemo_rl.models.policy.loss_interface import LossFunction
from nemo_rl.models.policy.worker_base import PolicyWorkerBase
from nemo_rl.weight_sync.scope import RefitScope


class NonFiniteTrainingError(UserError):
    """Training stopped after ``policy.max_nonfinite_steps`` optimizer steps in a row with a non-finite loss
    or gradient norm (shown as a one-line message: a learning rate or data problem the user can fix)."""


# How long one collective call on the workers may take before the driver reports the workers still running
# instead of waiting forever (loading or training a large model legitimately takes hours, a hang forever).
WORKER_CALL_TIMEOUT_S = 6 * 3600.0

MEGATRON_WORKER_MODULE = "nemo_rl.models.policy.megatron_worker"

# Batches are dealt to the dp ranks by this per-sequence length so that their token counts are similar.
LENGTH_KEY = "input_lengths"


@dataclass(frozen=True)
class WorkerBackend:
    """The policy worker backend a config selects (the one place that tells DTensor and Megatron apart)."""

    worker_cls: type[PolicyWorkerBase]
    model_parallel_size: int
    """Ranks sharing one data shard."""
    trains_lora: bool
    """Whether the policy trains LoRA adapters (the workers then report their size at start)."""
    expert_parallel_size: int = 1
    """Ranks a MoE layer's experts are split over (among the data-parallel ranks)."""


def _worker_backend(cfg: PolicyConfig) -> WorkerBackend:
    """The worker backend the config selects."""
    if cfg.dtensor_cfg.enabled:
        dtensor = cfg.dtensor_cfg
        model_parallel_size = dtensor.tensor_parallel_size * dtensor.context_parallel_size
        return WorkerBackend(DTensorPolicyWorker, model_parallel_size, dtensor.lora_cfg.enabled)
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise UserError(
            "policy.megatron_cfg.enabled=true but megatron-core is not installed: install the `mcore` extra "
            "(uv sync --extra mcore), or use the DTensor backend (policy.dtensor_cfg.enabled=true "
            "policy.megatron_cfg.enabled=false)"
        )
    worker_cls: type[PolicyWorkerBase] = importlib.import_module(MEGATRON_WORKER_MODULE).MegatronPolicyWorker
    megatron = cfg.megatron_cfg
    model_parallel_size = (
        megatron.tensor_model_parallel_size
        * megatron.pipeline_model_parallel_size
        * megatron.context_parallel_size
    )
    return WorkerBackend(
        worker_cls, model_parallel_size, megatron.peft.enabled, megatron.expert_model_parallel_size
    )


def check_policy_layout(cfg: PolicyConfig, world_size: int) -> int:
    """The policy's data-parallel size on ``world_size`` workers; raises :class:`UserError` when the workers
    do not divide into its model-parallel groups, ``policy.train_global_batch_size`` or the expert-parallel
    size does not divide over the data-parallel ranks, or the settings do not fit the model
    (:func:`~nemo_rl.models.policy.hf_io.check_model_settings`). Ray-free, so setups call it before starting
    anything."""
    backend = _worker_backend(cfg)
    model_parallel_size = backend.model_parallel_size
    check_model_settings(cfg)
    if world_size % model_parallel_size != 0:
        raise UserError(
            f"the policy runs on {world_size} workers, which is not a multiple of its model-parallel size "
            f"({model_parallel_size}); change cluster.gpus_per_node / num_nodes or the parallel sizes"
        )
    dp_size = world_size // model_parallel_size
    if cfg.train_global_batch_size % dp_size != 0:
        raise UserError(
            f"policy.train_global_batch_size={cfg.train_global_batch_size} does not divide over the policy's "
            f"{dp_size} data-parallel ranks ({world_size} workers / model-parallel size {model_parallel_size}); "
            "make it a multiple"
        )
    ep = backend.expert_parallel_size
    if dp_size % ep != 0:
        raise UserError(
            f"policy.megatron_cfg.expert_model_parallel_size={ep} does not divide the policy's {dp_size} "
            "data-parallel ranks (experts are split over data-parallel ranks); change it or the worker count"
        )
    return dp_size


class Policy(WorkerGroupFacade):
    """A policy model sharded over ``cluster``'s bundles (or ``bundle_indices`` of them)."""

    def __init__(
        self,
        cluster: RayVirtualCluster | LocalCluster,
        cfg: PolicyConfig,
        tokenizer_path: str | None = None,
        name_prefix: str = "policy",
        bundle_indices: Sequence[int] | None = None,
        init_reference_model: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
    ) -> None:
        """Start the workers and wait until every one has loaded its shard of the model.

        ``tokenizer_path`` is saved next to exported checkpoints (default: the tokenizer ``cfg`` names).
        ``weights_path`` / ``optimizer_path`` resume from a :meth:`save_checkpoint`; ``init_reference_model``
        keeps the initial weights for :meth:`get_reference_policy_logprobs`.
        """
        backend = _worker_backend(cfg)
        world_size = cluster.world_size if bundle_indices is None else len(bundle_indices)
        check_policy_layout(cfg, world_size)
        self.cfg = cfg
        self.num_nonfinite_steps = 0
        """Optimizer steps of this run skipped for a non-finite loss or gradient norm."""
        self.nonfinite_steps_in_a_row = 0
        """Of those, how many came last in a row (see ``policy.max_nonfinite_steps``)."""
        workers = start_worker_group(
            cluster,
            backend.worker_cls,
            name=name_prefix,
            init_kwargs={
                "cfg": cfg,
                "tokenizer_path": tokenizer_path,
                "weights_path": weights_path,
                "optimizer_path": optimizer_path,
                "init_reference_model": init_reference_model,
            },
            bundle_indices=bundle_indices,
            dp_size=world_size // backend.model_parallel_size,
        )
        super().__init__(workers, call_timeout_s=WORKER_CALL_TIMEOUT_S)
        if backend.trains_lora:
            summary: LoraSummary = self._on_rank_0("lora_summary")
            print(summary.describe(name_prefix), flush=True)

    # ------------------------------------------------------------------------------------------ calls
    def _prompt_run_length(self, data: BatchedDataDict[Any], rows_per_shard: int) -> int:
        """With ``policy.shared_prefix``, the length ``G`` of the runs of consecutive rows that share a prompt
        (GRPO's samples of one prompt) when every run has it and it divides ``rows_per_shard``: dealing the
        rows to the dp ranks in whole runs keeps each prompt's rows on one rank, where they share its forward
        (dealt one by one by length, a prompt's rows would land on every rank and share nothing). 1 otherwise.
        """
        if not self.cfg.shared_prefix.enabled or self.dp_size == 1 or "token_mask" not in data:
            return 1
        token_mask_BT, ids_BT = data["token_mask"], data["input_ids"]
        trained_BT = token_mask_BT > 0
        # A row's prompt: its tokens before its first trained token (as the workers find them).
        starts = torch.where(trained_BT.any(dim=1), trained_BT.int().argmax(dim=1), 0).tolist()
        keys = [tuple(ids_BT[row, :start].tolist()) for row, start in enumerate(starts)]
        runs: list[int] = []
        for row, key in enumerate(keys):
            if row > 0 and key and key == keys[row - 1]:
                runs[-1] += 1
            else:
                runs.append(1)
        run = runs[0]
        if run > 1 and all(r == run for r in runs) and rows_per_shard % run == 0:
            return run
        return 1

    def _score(self, method: str, data: BatchedDataDict[Any], *args: Any) -> BatchedDataDict[Any]:
        """Shard ``data`` over the dp groups, run ``method`` and put the rows back in their original order.

        Every dp group must see the same number of rows (the workers' forward passes are collectives over
        the dp axis), so the batch is padded by repeating its last row and the padding dropped afterwards.
        """
        num_rows = data.size
        if num_rows == 0:
            raise ValueError(f"{method} got an empty batch")
        num_padded = -num_rows % self.dp_size
        padded = data.select_indices(list(range(num_rows)) + [num_rows - 1] * num_padded)
        length_key = LENGTH_KEY if LENGTH_KEY in padded else None
        indices = padded.shard_indices(
            self.dp_size,
            balance_by_length_key=length_key,
            group_size=self._prompt_run_length(padded, padded.size // self.dp_size),
        )
        shards = [padded.select_indices(rows) for rows in indices]
        refs = self.worker_group.run_all_workers_sharded_data(method, shards, *args)
        results = self.worker_group.get_dp_leader_results(refs, self.call_timeout_s)
        return BatchedDataDict.from_shards(results, indices).slice(0, num_rows)

    # ------------------------------------------------------------------------------ PolicyInterface
    def get_logprobs(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"logprobs": [B, T]}``, aligned with ``data["input_ids"]`` (0 at position 0 and padding)."""
        return self._score("get_logprobs", data)

    def get_reference_policy_logprobs(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"reference_logprobs": [B, T]}`` under the initial weights."""
        return self._score("get_reference_policy_logprobs", data)

    def get_topk_logits(self, data: BatchedDataDict[Any], k: int) -> BatchedDataDict[Any]:
        """``{"topk_logits", "topk_indices"}`` [B, T, k]: the ``k`` largest next-token logits per position."""
        return self._score("get_topk_logits", data, k)

    def score(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"scores": [B]}``: each sequence's reward (reward models only)."""
        return self._score("score", data)

    def get_values(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"values": [B, T]}``: a value model's value of the state before each token (0 at position 0 and
        padding; value models only, see ``PolicyWorkerBase.get_values``)."""
        return self._score("get_values", data)

    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimizer step per global batch of ``gbs`` rows of ``data`` (in order); see ``PolicyInterface``."""
        global_batch_size = gbs if gbs is not None else self.cfg.train_global_batch_size
        length_key = LENGTH_KEY if LENGTH_KEY in data else None
        # Dealing rows within each global batch leaves every step's batch, hence its loss, unchanged; groups
        # of rows the loss reads together (preference pairs) are dealt whole.
        group_size = loss_fn.rows_per_group
        if group_size == 1:
            group_size = self._prompt_run_length(data, global_batch_size // self.dp_size)
        shards = data.shard_by_batch_size(
            self.dp_size,
            batch_size=global_batch_size,
            balance_by_length_key=length_key,
            group_size=group_size,
        )
        refs = self.worker_group.run_all_workers_sharded_data(
            "train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=global_batch_size, mbs=mbs
        )
        # The workers all-reduce losses and metrics over dp, so every leader returns the same result.
        result: TrainResult = self.worker_group.get_dp_leader_results(refs, self.call_timeout_s)[0]
        if not eval_mode:
            self._count_nonfinite_steps(result)
        return result

    def _count_nonfinite_steps(self, result: TrainResult) -> None:
        """Count optimizer steps with a non-finite loss or gradient norm (the workers skipped their
        updates); stop after ``policy.max_nonfinite_steps`` of them in a row."""
        flags = nonfinite_step_flags(result)
        losses = result["loss"].reshape(-1).tolist()
        grad_norms = (
            result["grad_norm"].reshape(-1).tolist() if "grad_norm" in result else [0.0] * len(losses)
        )
        for nonfinite, loss, grad_norm in zip(flags, losses, grad_norms, strict=True):
            if not nonfinite:
                self.nonfinite_steps_in_a_row = 0
                continue
            self.num_nonfinite_steps += 1
            self.nonfinite_steps_in_a_row += 1
            limit = self.cfg.max_nonfinite_steps
            if limit and self.nonfinite_steps_in_a_row >= limit:
                raise NonFiniteTrainingError(
                    f"stopping: {self.nonfinite_steps_in_a_row} optimizer steps in a row had a non-finite loss "
                    f"or gradient norm (loss {loss}, grad norm {grad_norm}) and were skipped; the last "
                    "checkpoint is intact: lower the learning rate or check the data, then rerun to resume "
                    "(policy.max_nonfinite_steps sets how many are tolerated)"
                )

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Save sharded weights (and optimizer + scheduler state) with torch.distributed.checkpoint."""
        self._on_all("save_checkpoint", weights_path, optimizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load what :meth:`save_checkpoint` wrote."""
        self._on_all("load_checkpoint", weights_path, optimizer_path)

    def export_hf(self, path: str) -> None:
        """Write a Hugging Face checkpoint that ``AutoModelForCausalLM.from_pretrained(path)`` loads."""
        self._on_all("export_hf", path)

    def prepare_for_training(self) -> None:
        """Weights and optimizer state onto the devices; training mode. Not waited for: the workers run it
        before the next call (``train``), whose wait also raises its errors."""
        self._on_all_deferred("prepare_for_training")

    def prepare_for_lp_inference(self) -> None:
        """Weights onto the devices, optimizer state to the host; inference mode. Not waited for, as
        :meth:`prepare_for_training`."""
        self._on_all_deferred("prepare_for_lp_inference")

    def offload_before_refit(self) -> None:
        """Optimizer state to the host before the weights are sent to generation."""
        self._on_all("offload_before_refit")

    def offload_after_refit(self) -> None:
        """Weights and optimizer state to the host after a refit (colocated generation gets the devices)."""
        self._on_all("offload_after_refit")

    # ------------------------------------------------------------------------------- refit (sender)
    def weights_manifest(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (full shape, dtype name)}`` of the weights a refit of ``scope`` sends (from rank 0)."""
        manifest: dict[str, tuple[tuple[int, ...], str]] = self._on_rank_0("weights_manifest", dtype, scope)
        return manifest

    def trains_with_dropout(self) -> bool:
        """Whether the training forward differs from the scoring forward (see ``hf_io.trains_with_dropout``),
        answered by a worker, which has the model's config loaded: loading it in the driver imports
        transformers' model code there."""
        return bool(self._on_rank_0("trains_with_dropout"))

    def adapter_refits(self) -> bool:
        """Whether refits after the first may move the LoRA adapters alone (asked of the workers: the DTensor
        backend sends them unmerged, the Megatron backend folds them into the weights)."""
        return bool(self._on_rank_0("adapter_refits"))

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order (for choosing the refit transport)."""
        group = self.worker_group
        locations = group.cluster.bundle_locations()
        return [locations[b].node_id for b in group.bundle_indices]

    def refit_streams(self) -> list[int]:
        """The refit stream each worker sends, in rank order: its pipeline stage (Megatron; each stage sends
        its own layers), or 0 for every worker (DTensor; one stream of the whole model)."""
        streams: list[int] = self._on_all("refit_stream")
        return streams
