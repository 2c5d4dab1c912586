"""The Megatron policy worker: one rank of a megatron-core ``GPTModel`` with tensor, pipeline and data parallelism.

It offers the same methods as :class:`~nemo_rl.models.policy.dtensor_worker.DTensorPolicyWorker`, so ``Policy``
and the algorithms never branch on the backend. Each worker is one process of a (dp, pp, tp) grid laid out
tensor-parallel fastest (``nemo_rl.models.megatron.setup.RANK_ORDER``), so the ranks of one data-parallel
replica are consecutive, as ``RayWorkerGroup`` deals data shards. Every public method is a collective.

- **Model.** ``GPTModel`` built from the Hugging Face config of a Llama / Qwen2 / Qwen3 checkpoint
  (:mod:`nemo_rl.models.megatron.families`); every rank reads its own slice of its stage's weights from the
  checkpoint (:mod:`nemo_rl.models.megatron.weights`). Transformer Engine layers on CUDA when installed, the
  local megatron-core layers otherwise. On a machine without CUDA, megatron-core's CUDA-only calls are
  redirected to the host (:mod:`nemo_rl.models.megatron.cpu_compat`) and the groups use gloo.
- **Context parallelism** (``megatron_cfg.context_parallel_size``, CUDA with Transformer Engine only): each rank
  runs its load-balanced chunks of every row and the last stage's output is gathered back to full rows
  (:mod:`nemo_rl.models.megatron.context_parallel`).
- **Micro-batches** flow through megatron-core's pipeline schedule (1F1B with PP > 1). The loss runs on the
  last stage on the full-vocabulary logits (gathered over TP) of the sampling distribution (temperature,
  top-k, top-p) as in the DTensor worker. The normalisation is the DTensor worker's: the global batch's valid sequence / token
  counts are all-reduced first, each micro-batch's loss is its share of the global loss, and gradients are
  summed over data-parallel ranks (``calculate_per_token_loss`` with no rescaling), so the loss and the
  gradients do not depend on the dp size, the micro-batch size or the pipeline depth.
- **Optimizer.** Megatron's (optionally distributed) Adam / SGD with its ``OptimizerParamScheduler``, stepped
  once per optimizer step; biases and norms are not weight-decayed (Megatron's grouping). A step whose
  gradient norm is not finite is skipped.
- **Refit / export** stream Hugging Face tensors stage by stage: each parameter is gathered over TP when it
  is reached, and each pipeline stage sends (or writes) its own layers.
- **Value model** (``reward_model_cfg`` with ``reward_model_type: regression``, PPO's critic): the last stage
  ends in a scalar head per token instead of the LM output layer (:mod:`nemo_rl.models.megatron.value_head`);
  losses and ``get_values`` receive its output ``head_BT`` [B, T] and the log-prob methods refuse.
- **LoRA** (``megatron_cfg.peft``): the adapters of :mod:`nemo_rl.models.megatron.lora` on the frozen model,
  the DTensor backend's adapters under their Hugging Face names; the reference policy switches them off,
  checkpoints hold them alone, refits and exports fold them into the weights.

Tensor legend: B = sequences, T = tokens, V = vocabulary, K = top-k.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from nemo_rl.config.megatron import no_effect_settings
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import (
    configure_worker_threads,
    cuda_available,
    get_device,
    init_process_group_from_env,
)
from nemo_rl.models.hf_config import load_hf_config
from nemo_rl.models.hf_decoder import SafetensorsReader, decoder_arch, resolve_checkpoint_dir
from nemo_rl.models.lora import adapters_disabled
from nemo_rl.models.megatron import checkpoint, cpu_compat, setup, value_head
from nemo_rl.models.megatron.context_parallel import context_parallel_for
from nemo_rl.models.megatron.families import family_for
from nemo_rl.models.megatron.lora import MegatronLoRA
from nemo_rl.models.megatron.moe import (
    RouterScores,
    attach_routing_log,
    freeze_routers,
    install_replay,
    megatron_aux_loss,
    megatron_rows,
    recording,
    replaying,
    valid_rows,
)
from nemo_rl.models.megatron.weights import (
    StageWeights,
)
from nemo_rl.models.policy.hf_io import initial_lora_adapters
from nemo_rl.models.policy.loss_interface import LossFunction
from nemo_rl.models.policy.megatron_weights_io import MegatronWeightsMixin
from nemo_rl.models.policy.moe import RoutingRecord, aux_loss_coef_of, moe_step_terms
from nemo_rl.models.policy.utils import global_valid_counts, pad_sequence_dim, valid_token_mask
from nemo_rl.models.policy.worker_base import PolicyWorkerBase, ScoreFn
from nemo_rl.models.policy.worker_batches import StepBatch, TrainLog, merge_rows
from nemo_rl.models.sampling import sampling_logits

logger = logging.getLogger(__name__)


class MegatronPolicyWorker(MegatronWeightsMixin, PolicyWorkerBase):
    """One rank of the Megatron policy; run as a Ray actor by ``RayWorkerGroup``."""

    def _build(self, init_reference_model: bool) -> None:
        """Join the process groups, build this rank's stage from ``cfg.model_name``, the optimizer and schedule."""
        cfg = self.cfg
        megatron = cfg.megatron_cfg
        if megatron.env_vars:
            os.environ.update(megatron.env_vars)
        configure_worker_threads()
        init_process_group_from_env()
        cpu_compat.install()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        model_parallel = megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size
        model_parallel *= megatron.context_parallel_size
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"the policy has {self.world_size} workers, not a multiple of tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {model_parallel}"
            )
        self.device = get_device()
        self.hf_config = load_hf_config(
            cfg.model_name, trust_remote_code=cfg.trust_remote_code, overrides=cfg.hf_config_overrides
        )
        architectures = list(getattr(self.hf_config, "architectures", None) or [])
        if megatron.converter_type is not None and megatron.converter_type not in architectures:
            raise ValueError(
                f"policy.megatron_cfg.converter_type={megatron.converter_type!r} but {cfg.model_name} is a "
                f"{architectures}: set converter_type to the checkpoint's architecture (or null)"
            )
        self.arch = decoder_arch(self.hf_config)
        self.family = family_for(self.arch)
        setup.check_divisibility(self.arch, megatron)
        self.checkpoint_dir = resolve_checkpoint_dir(cfg.model_name)
        with cpu_compat.device_redirect():
            setup.init_model_parallel(megatron)
            uses_te = setup.uses_transformer_engine(megatron, self.arch)
            self.cp = context_parallel_for(megatron.context_parallel_size, uses_te)
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.pp_group = parallel_state.get_pipeline_model_parallel_group()
            self.dp_group = parallel_state.get_data_parallel_group()
            self.dp_rank = parallel_state.get_data_parallel_rank()
            self.dp_size = parallel_state.get_data_parallel_world_size()
            self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
            self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            self.is_last_stage = parallel_state.is_pipeline_last_stage()
            self.ep_rank = parallel_state.get_expert_model_parallel_rank()
            self.ep_size = parallel_state.get_expert_model_parallel_world_size()
            self._build_stage()
            self.model = setup.wrap_for_training(self.gpt, cfg, self.config)
            self.optimizer = setup.build_optimizer(cfg, self.model)
            self.scheduler = setup.build_scheduler(cfg, self.optimizer)
        sp_multiple = megatron.tensor_model_parallel_size if megatron.sequence_parallel else 1
        cp_multiple = 2 * megatron.context_parallel_size if self.cp is not None else 1
        self.seq_multiple = math.lcm(cfg.make_sequence_length_divisible_by, sp_multiple, cp_multiple)
        # The reference policy is a host copy of this rank's initial shards, swapped in only while scoring;
        # with LoRA it is the frozen base model itself (the adapters switched off), so no copy is kept.
        self.has_reference = init_reference_model
        self.reference_shards = self.weights.snapshot() if init_reference_model and not self.lora else None
        if self.rank == 0:
            self._warn_unused_settings()

    def _warn_unused_settings(self) -> None:
        """Warn about accepted settings this backend does not use."""
        for setting in no_effect_settings(self.cfg.megatron_cfg):
            logger.warning("policy.megatron_cfg.%s is accepted but has no effect here", setting)
        if self.cfg.optimizer is not None or self.cfg.scheduler:
            logger.warning(
                "policy.optimizer / policy.scheduler configure the DTensor backend and are not used; the "
                "Megatron backend trains with policy.megatron_cfg.optimizer / scheduler"
            )

    def _build_stage(self) -> None:
        """This rank's stage of the ``GPTModel`` with its weights (and LoRA adapters) loaded; unwrapped."""
        cfg = self.cfg
        megatron = cfg.megatron_cfg
        self.config = setup.transformer_config(self.arch, self.family, cfg)
        self.gpt = setup.build_model(self.arch, cfg, self.config)
        self.lora = (
            MegatronLoRA.from_config(megatron.peft, self.arch.num_layers) if megatron.peft.enabled else None
        )
        if self.lora is not None:
            self.lora.attach(self.gpt, self.arch, self.config)
        self.routing_log = attach_routing_log(self.gpt)
        self.replays = install_replay(self.gpt) if cfg.router_replay.enabled else []
        self._routing: RoutingRecord | None = None
        """The routing of the micro-batch whose loss runs next (MoE models)."""
        sigmoid = self.arch.moe is not None and self.arch.moe.router == "sigmoid"
        self.router_scores = RouterScores(sigmoid, aux_loss_coef_of(self.hf_config))
        self.megatron_aux_coef: float | None = None
        """Coefficient of megatron-core's ``aux_loss`` when ``moe_router_load_balancing_type`` asks for it."""
        if megatron.moe_router_load_balancing_type == "aux_loss":
            coef = megatron.moe_aux_loss_coeff
            self.megatron_aux_coef = (
                coef if coef is not None else float(getattr(self.hf_config, "router_aux_loss_coef", 0.0))
            )
        if megatron.freeze_moe_router:
            freeze_routers(self.gpt)
        self.weights = StageWeights(
            self.gpt,
            self.arch,
            self.family,
            first_stage=parallel_state.is_pipeline_first_stage(),
            last_stage=self.is_last_stage,
            te_norms=setup.uses_transformer_engine(megatron, self.arch),
            tp_group=self.tp_group,
            adapted=self.lora.selected if self.lora is not None else None,
            experts=self._local_experts(),
            streams_shared=self.ep_rank == 0,
            value_head=self.is_value_model,
        )
        reader = SafetensorsReader(self.checkpoint_dir)
        get: Callable[[str], torch.Tensor] = reader.get
        if self.is_value_model:
            get = value_head.checkpoint_getter(
                reader, self.arch.hidden_size, self.hf_config.initializer_range
            )
        self.weights.load(get, self.weights.base_rules)
        if self.lora is not None:
            self.weights.load(self._initial_adapters().__getitem__, self.weights.adapter_rules)

    def _local_experts(self) -> range:
        """The routed experts (global indices) this rank holds in each MoE layer (none for a dense model)."""
        if self.arch.moe is None:
            return range(0)
        per_rank = self.arch.moe.num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def _initial_adapters(self) -> dict[str, torch.Tensor]:
        """The initial LoRA adapters (full, Hugging Face names), drawn on rank 0 as the DTensor backend draws
        them (:func:`~nemo_rl.models.policy.hf_io.initial_lora_adapters`) and broadcast: both backends start
        from the same adapters."""
        assert self.lora is not None
        box = [initial_lora_adapters(self.cfg, self.lora.lora_config) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        adapters = box[0]
        assert adapters is not None
        return adapters

    # ----------------------------------------------------------------------------------------- forward
    def _model_output(self, output: torch.Tensor, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """What losses and scoring functions receive from the last stage's output: the logits of the sampling
        distribution [B, T, V], or a value model's head at every position [B, T] (``head_BT``)."""
        if self.is_value_model:
            return value_head.head_BT(output, mb["input_lengths"])
        return self._logits(output, mb)

    def _logits(self, output_BTV: torch.Tensor, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """[B, T, V] float32 logits of the sampling distribution from the last stage's output (vocabulary
        padding cut; temperature, top-k, top-p as ``nemo_rl.models.sampling.sampling_logits``)."""
        generation = self.cfg.generation
        return sampling_logits(
            output_BTV[..., : self.arch.vocab_size].float(),
            mb["input_ids"],
            generation.temperature,
            generation.top_k,
            generation.top_p,
        )

    def _run_pipeline(
        self,
        mbs: list[BatchedDataDict[Any]],
        loss_func: Callable[..., Any],
        *,
        forward_only: bool,
        collect_outputs: bool = False,
    ) -> list[Any]:
        """Megatron's forward(-backward) schedule over ``mbs``; ``loss_func(mb, output)`` runs on the last stage.

        Returns what ``loss_func`` returned per micro-batch (its third element when training) on the last
        stage, and an empty list on the other stages.
        """

        def forward_step(data_iterator: Iterator[BatchedDataDict[Any]], model: torch.nn.Module) -> Any:
            mb = next(data_iterator)
            input_ids_BT = mb["input_ids"]
            positions_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(
                input_ids_BT
            )
            # Right padding under a causal mask: real tokens never attend to padding.
            # Routing replay (policy.router_replay): the routers take the sampler's experts.
            rows_NLK = (
                megatron_rows(mb["routed_experts"], mb["input_lengths"]) if "routed_experts" in mb else None
            )
            if self.cp is not None:  # this rank's chunks of each row (megatron_cfg.context_parallel_size)
                input_ids_BT, positions_BT = self.cp.split(input_ids_BT, positions_BT)
            with recording(self.routing_log) as routing, replaying(self.replays, rows_NLK):
                output = model(input_ids_BT, positions_BT, None, runtime_gather_output=True)
            if self.cp is not None and self.is_last_stage:
                output = self.cp.gather(output)
            # Megatron runs the loss of a micro-batch right after its forward (one stage for MoE models).
            self._routing = routing
            return output, partial(loss_func, mb)

        seq_len = max(int(mb["input_ids"].shape[1]) for mb in mbs)
        rows = max(mb.size for mb in mbs)
        with cpu_compat.device_redirect():
            return list(
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(mbs),
                    model=[self.model],
                    num_microbatches=len(mbs),
                    seq_length=seq_len,
                    micro_batch_size=rows,
                    forward_only=forward_only,
                    collect_non_loss_data=collect_outputs,
                )
            )

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` of the last pipeline stage, on every stage (an object broadcast over the PP group)."""
        if self.pp_size == 1:
            return value
        box = [value if self.is_last_stage else None]
        dist.broadcast_object_list(
            box, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=self.pp_group
        )
        return box[0]

    @torch.no_grad()
    def _score(
        self, data: BatchedDataDict[Any], fn: ScoreFn, micro_batch_size: int | None
    ) -> BatchedDataDict[Any]:
        """Run ``fn(logits, micro_batch)`` over ``data`` in inference mode and concatenate its [B, T, ...] outputs."""
        if data.size == 0:
            raise ValueError("every data-parallel rank needs at least one sequence to score")
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        batch = pad_sequence_dim(data, self.seq_multiple)
        parts = list(self._micro_batches(batch, mbs, self.cfg.dynamic_batching.logprob_mb_tokens))
        self.model.eval()

        def collect(mb: BatchedDataDict[Any], output: torch.Tensor, non_loss_data: bool = True) -> Any:
            return {key: value.cpu() for key, value in fn(self._model_output(output, mb), mb).items()}

        outputs = self._run_pipeline(
            [mb for _, mb in parts], collect, forward_only=True, collect_outputs=True
        )
        merged = None
        if self.is_last_stage:
            merged = merge_rows(
                [(rows, out) for (rows, _), out in zip(parts, outputs, strict=True)],
                data.size,
                int(data["input_ids"].shape[1]),
            )
        result: BatchedDataDict[Any] = self._from_last_stage(merged)
        return result

    def score(self, data: BatchedDataDict[Any], micro_batch_size: int | None = None) -> BatchedDataDict[Any]:
        """Bradley-Terry reward models run on the DTensor backend only (the schema refuses them here)."""
        raise ValueError(
            "score() needs a Bradley-Terry reward model, which the Megatron backend does not build (its scalar "
            "head is a value model's, read with get_values()): use the DTensor backend for reward models"
        )

    # ---------------------------------------------------------------------------------------- training
    def _forward_backward(
        self, step: StepBatch, loss_fn: LossFunction, eval_mode: bool
    ) -> tuple[float, list[dict[str, Any]]]:
        """The step's micro-batches through the pipeline schedule; every stage gets the last stage's loss and
        metric shares."""

        def loss_func(
            mb: BatchedDataDict[Any], output: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            loss, metrics = loss_fn(
                self._model_output(output, mb), mb, step.global_valid_seqs, step.global_valid_toks
            )
            if self._routing is not None:
                loss, metrics = self._with_moe_terms(loss, metrics, mb, step)
            # Megatron's (num_tokens) slot is unused: the loss is already this micro-batch's global share.
            count = torch.ones((), dtype=torch.int, device=loss.device)
            return loss, count, {"loss": loss.detach(), "metrics": metrics}

        if not eval_mode:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        parts = list(
            self._micro_batches(step.batch, step.micro_batch_size, self.cfg.dynamic_batching.train_mb_tokens)
        )
        with torch.set_grad_enabled(not eval_mode):
            outputs = self._run_pipeline([mb for _, mb in parts], loss_func, forward_only=eval_mode)
        step_loss: float
        mb_metrics: list[dict[str, Any]]
        step_loss, mb_metrics = self._from_last_stage(
            (sum(float(out["loss"]) for out in outputs), [out["metrics"] for out in outputs])
            if self.is_last_stage
            else None
        )
        return step_loss, mb_metrics

    def _with_moe_terms(
        self, loss: torch.Tensor, metrics: dict[str, Any], mb: BatchedDataDict[Any], step: StepBatch
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's loss plus the load-balancing losses (``transformers``' when the model config asks
        for it, megatron-core's ``aux_loss`` when ``megatron_cfg`` does) and its metrics plus the routing
        metrics, weighted by its share of the step's loss tokens, as the DTensor worker weights them."""
        assert self._routing is not None
        input_ids_BT = mb["input_ids"]
        valid_N = valid_rows(
            valid_token_mask(mb["input_lengths"].to(input_ids_BT.device), input_ids_BT.shape[1])
        )
        share = float(global_valid_counts(mb)[1]) / max(float(step.global_valid_toks), 1.0)
        moe_loss, moe_metrics = moe_step_terms(self.router_scores, self._routing, valid_N, share)
        if self.megatron_aux_coef is not None and self.arch.moe is not None:
            aux = megatron_aux_loss(self.router_scores, self._routing, valid_N, self.arch.moe.top_k)
            moe_loss = moe_loss + self.megatron_aux_coef * share * aux
            moe_metrics["moe_megatron_aux_loss"] = float(aux.detach()) * share
        return loss + moe_loss, {**metrics, **moe_metrics}

    def _optimizer_step(self, log: TrainLog) -> None:
        """Megatron's optimizer step (clipping inside; skipped for a non-finite gradient norm)."""
        self._release_cached_memory(level=1)
        with cpu_compat.device_redirect():
            stepped = setup.optimizer_step(self.optimizer, self.cfg.megatron_cfg.optimizer.clip_grad)
        log.add_update(stepped.grad_norm, float(self.optimizer.param_groups[0]["lr"]))
        if stepped.stepped:
            self.scheduler.step(increment=1)
        else:
            logger.warning("skipping the optimizer step: the gradient norm is %s", stepped.grad_norm)
        self._release_cached_memory(level=2)

    def _release_cached_memory(self, level: int) -> None:
        """``torch.cuda.empty_cache()`` when ``megatron_cfg.empty_unused_memory_level`` is at least ``level``."""
        if cuda_available() and self.cfg.megatron_cfg.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------ reference weights
    @contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """Swap the reference weights into this rank's parameters for the duration of the block (with LoRA:
        switch the adapters off)."""
        if self.lora is not None and self.has_reference:
            with adapters_disabled(self.gpt):
                yield
            return
        if self.reference_shards is None:
            raise RuntimeError(
                "this policy was built with init_reference_model=False, so it has no reference weights"
            )
        current = self.weights.snapshot()
        self.weights.restore(self.reference_shards)
        try:
            yield
        finally:
            self.weights.restore(current)

    # --------------------------------------------------------------------------- memory / placement
    def _move(self, device: str) -> None:
        """Move the weights, gradient buffers and optimizer state to ``device`` ("cpu" or "cuda"; CUDA only).

        Without CUDA everything already lives in host memory and nothing moves.
        """
        if not cuda_available():
            return
        checkpoint.move_model(self.model, device)
        checkpoint.move_optimizer_state(self.model, self.optimizer, device)

    def prepare_for_training(self) -> None:
        """Weights and optimizer state onto the device; training mode."""
        self._move("cuda")
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        """Weights onto the device, optimizer state to the host; inference mode."""
        self._move("cuda")
        self.model.eval()
        self.offload_before_refit()

    def offload_before_refit(self) -> None:
        """Optimizer state to the host, so the refit's gather buffers fit on the device."""
        if cuda_available():
            checkpoint.move_optimizer_state(self.model, self.optimizer, "cpu")
            torch.cuda.empty_cache()

    def offload_after_refit(self) -> None:
        """Weights, gradient buffers and optimizer state to the host, leaving the device to generation."""
        self._move("cpu")
        if cuda_available():
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        """Drop the model, optimizer and reference weights, and Megatron's process groups."""
        del self.model, self.optimizer, self.scheduler, self.gpt, self.weights
        self.reference_shards = None
        parallel_state.destroy_model_parallel()
        if cuda_available():
            torch.cuda.empty_cache()
