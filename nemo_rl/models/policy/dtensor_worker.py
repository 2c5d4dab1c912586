"""The DTensor policy worker: one rank of an FSDP2 (+ tensor/sequence parallel) Hugging Face causal LM.

Each worker is one process of a (dp, cp, tp) device mesh laid out row-major
(``rank = (dp_rank * cp + cp_rank) * tp + tp_rank``; context parallelism: ``context_parallel.py``),
started by ``RayWorkerGroup`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. Every public method is
a collective: all ranks must call it, with the same data on the ranks of one dp group.

Normalisation: a global batch of ``gbs`` sequences is split over the dp ranks and, on each rank, into
micro-batches. The valid sequence and token counts of the whole global batch are all-reduced first and
given to the loss, which returns each micro-batch's share of the global loss; gradients accumulate over
micro-batches and are SUMMED over dp ranks (FSDP's averaging is switched off in ``parallelize.apply_fsdp``).
So the loss and gradients of a step do not depend on the dp size or the micro-batch size.

Sampling distribution: like NeMo RL, logits are divided by ``policy.generation.temperature`` and filtered by
its ``top_k`` / ``top_p`` before log-probs, top-k logits and losses, so the policy scores the same distribution
the sampler drew from (:func:`nemo_rl.models.sampling.sampling_logits`; a no-op at the defaults).

Reward models: with ``policy.reward_model_cfg.enabled`` the same worker holds the model with a scalar head
(``AutoModelForSequenceClassification``, one output) instead of the LM head. Its losses receive one reward per
sequence ([B], read at the sequence's last token) instead of logits, ``score`` returns those rewards, and the
log-prob methods refuse to run. With ``reward_model_type: regression`` the model is PPO's value model: its losses
receive the head's output at every token ([B, T]) and ``get_values`` returns it aligned with the tokens.
Everything else (sharding, training, checkpoints, export) is shared.

Tensor legend: B = sequences, T = tokens, V = vocabulary, K = top-k.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import (
    configure_worker_threads,
    cuda_available,
    get_device,
    init_process_group_from_env,
)
from nemo_rl.models.lora import lora_modules
from nemo_rl.models.policy.context_parallel import apply_context_parallel, sequence_multiple, worker_mesh
from nemo_rl.models.policy.dtensor_refit import DTensorRefitMixin
from nemo_rl.models.policy.dtensor_weights_io import DTensorWeightsMixin
from nemo_rl.models.policy.hf_io import frozen_patterns, load_sharded_model
from nemo_rl.models.policy.loss_interface import LossFunction
from nemo_rl.models.policy.moe import RouterRecorder, moe_step_terms, replay_rows
from nemo_rl.models.policy.optim import build_optimizer, build_scheduler, clip_grad_norm_, freeze_parameters
from nemo_rl.models.policy.parallelize import reshard_all
from nemo_rl.models.policy.shared_prefix import (
    SharedPrefixRows,
    identical_rows,
    prompt_lengths,
    shared_prefix_groups,
    use_shared_prefix_attention,
)
from nemo_rl.models.policy.utils import (
    PackedRows,
    fed_token_mask,
    global_valid_counts,
    pad_sequence_dim,
    valid_token_mask,
)
from nemo_rl.models.policy.worker_base import PolicyWorkerBase, ScoreFn
from nemo_rl.models.policy.worker_batches import StepBatch, TrainLog, merge_rows
from nemo_rl.models.sampling import sampling_logits
from nemo_rl.models.vlm import image_forward_inputs, vlm_token_ids

if TYPE_CHECKING:
    from nemo_rl.models.generation.embedded.replica import EmbeddedReplica

logger = logging.getLogger(__name__)

# DTensor and torch.distributed.checkpoint are imported in the methods that use them: the driver imports
# this module to start the workers, and importing them costs it seconds of CPU for nothing.


class DTensorPolicyWorker(DTensorWeightsMixin, DTensorRefitMixin, PolicyWorkerBase):
    """One rank of the DTensor policy; run as a Ray actor by ``RayWorkerGroup``."""

    def _build(self, init_reference_model: bool) -> None:
        """Join the process group, load and shard ``cfg.model_name``, build the optimizer and scheduler."""
        cfg = self.cfg
        dtensor_cfg = cfg.dtensor_cfg
        if dtensor_cfg.cpu_offload and not cuda_available():
            raise ValueError(
                "policy.dtensor_cfg.cpu_offload=true needs CUDA (FSDP2's CPUOffloadPolicy does not run on a "
                "CPU-only machine); set policy.dtensor_cfg.cpu_offload=false"
            )
        if dtensor_cfg.env_vars:
            os.environ.update(dtensor_cfg.env_vars)
        configure_worker_threads()
        init_process_group_from_env()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = get_device()
        self.mesh = worker_mesh(self.device.type, self.world_size, dtensor_cfg)
        self.dp_size = self.mesh["dp"].size()
        self.dp_group = self.mesh.get_group("dp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.seq_multiple = sequence_multiple(cfg.make_sequence_length_divisible_by, dtensor_cfg)

        self.model = load_sharded_model(cfg, self.mesh, self.device)
        self.moe_routing = RouterRecorder(self.model)
        apply_context_parallel(self.model, self.mesh["cp"], self.moe_routing)
        # Which rows of the last forward's input were real tokens, for the MoE terms (see _loss_with_moe_terms).
        self._fed_valid_N = torch.ones(0, dtype=torch.bool)
        trained = freeze_parameters(self.model, frozen_patterns(self.model, cfg))
        self.optimizer = build_optimizer(trained, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler)
        self.lora_targets = [name for name, _ in lora_modules(self.model)]
        self.has_reference = init_reference_model
        # The reference policy is a host copy of this rank's initial shards, swapped in only while scoring;
        # with LoRA it is the frozen base model itself (the adapters switched off), so no copy is kept.
        self.reference_shards: dict[str, torch.Tensor] | None = (
            self._snapshot_local_shards() if init_reference_model and not self.lora_targets else None
        )
        # The embedded engine replica this worker hosts (see init_embedded_generation); None on the ranks
        # that generate for no one.
        self._hosts_generation = False
        self._generation_replica: EmbeddedReplica | None = None

    # ----------------------------------------------------------------------------------------- forward
    def _forward(self, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """What the loss reads: next-token logits [B, T, V], or a reward model's rewards [B] (float32).

        With ``policy.shared_prefix.dedupe_rows`` rows identical in full run once and each copy reads the
        same output (indexing it sums their gradients, as separate copies would)."""
        unique = None
        if self.cfg.shared_prefix.enabled and self.cfg.shared_prefix.dedupe_rows:
            unique, copies = identical_rows(mb)
            mb = mb.select_indices(unique) if unique is not None else mb
        if self.is_value_model:
            out = self._values(mb)
        else:
            out = self._rewards(mb) if self.is_reward_model else self._logits(mb)
        return out if unique is None else out.index_select(0, copies.to(out.device))

    def _values(self, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """[B, T] float32: a value model's scalar head at every position (0 past each row's length), caught on
        its way out of the head (Hugging Face's sequence-classification forward then reads one token, which
        nothing uses). Packed and shared-prompt rows are mapped back to the batch's rows."""
        head_out: list[torch.Tensor] = []
        hook = self.model.get_submodule("score").register_forward_hook(
            lambda _module, _args, output: head_out.append(output)
        )
        packed = shared = None
        try:
            if self.cfg.packs_sequences:
                multiple = math.lcm(self.cfg.sequence_packing.sequence_length_round, self.seq_multiple)
                packed = PackedRows.pack(mb["input_ids"], mb["input_lengths"], multiple)
                self.model(
                    input_ids=packed.input_ids_1L, position_ids=packed.position_ids_1L, use_cache=False
                )
            elif self.cfg.shared_prefix.enabled and (shared := self._shared_prefix_rows(mb)) is not None:
                self.model(**self._shared_prefix_inputs(shared))
            else:
                self.model(input_ids=mb["input_ids"], use_cache=False)
        finally:
            hook.remove()
        from torch.distributed.tensor import DTensor

        head = head_out[0].full_tensor() if isinstance(head_out[0], DTensor) else head_out[0]
        layout = packed or shared
        valid_BT = valid_token_mask(mb["input_lengths"].to(head.device), mb["input_ids"].shape[1])
        self._fed_valid_N = (
            fed_token_mask(layout.index_BT, layout.valid_BT, head.shape[1])
            if layout is not None
            else valid_BT
        ).reshape(-1)
        head_BT = (layout.unpack(head) if layout is not None else head)[..., 0].float()
        return head_BT * valid_BT

    def _rewards(self, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """[B] float32 reward of each sequence: the scalar head's output at its last token."""
        if self.cfg.shared_prefix.enabled and (shared := self._shared_prefix_rows(mb)) is not None:
            return self._shared_prefix_rewards(mb, shared)
        ids_BT = mb["input_ids"]
        valid_BT = valid_token_mask(mb["input_lengths"].to(ids_BT.device), ids_BT.shape[1])
        # HF's sequence-classification models score the last token that is not the pad token, so every
        # position past a sequence's length (collate padding, and the zeros pad_sequence_dim adds) is set to
        # it: the score is then exactly what the exported model gives AutoModelForSequenceClassification users.
        hf_config: Any = self.model.config
        ids_BT = torch.where(valid_BT, ids_BT, int(hf_config.pad_token_id))
        self._fed_valid_N = valid_BT.reshape(-1)
        scores = self.model(input_ids=ids_BT, use_cache=False).logits
        from torch.distributed.tensor import DTensor

        if isinstance(scores, DTensor):
            scores = scores.full_tensor()
        return scores.float().reshape(ids_BT.shape[0])

    def _shared_prefix_rewards(self, mb: BatchedDataDict[Any], shared: SharedPrefixRows) -> torch.Tensor:
        """[B] float32 rewards from the shared-prompt forward: the scalar head's per-token output over the
        packed row (caught on its way out of the head, before Hugging Face reads one token of the packed
        row), mapped back to the rows and read at each row's last token."""
        head_out: list[torch.Tensor] = []
        hook = self.model.get_submodule("score").register_forward_hook(
            lambda _module, _args, output: head_out.append(output)
        )
        try:
            self.model(**self._shared_prefix_inputs(shared))
        finally:
            hook.remove()
        from torch.distributed.tensor import DTensor

        scores_1L = head_out[0].full_tensor() if isinstance(head_out[0], DTensor) else head_out[0]
        scores_BT = shared.unpack(scores_1L)[..., 0]
        # Read where Hugging Face reads an unshared row: its last token that is not the pad token.
        ids_BT = mb["input_ids"].to(scores_BT.device)
        valid_BT = valid_token_mask(mb["input_lengths"].to(ids_BT.device), ids_BT.shape[1])
        hf_config: Any = self.model.config
        read_BT = valid_BT & (ids_BT != int(hf_config.pad_token_id))
        positions_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        last_B = (positions_BT * read_BT).argmax(dim=1)
        return scores_BT.gather(1, last_B[:, None])[:, 0].float()

    @staticmethod
    def _shared_prefix_inputs(shared: SharedPrefixRows) -> dict[str, Any]:
        """The model's keywords for a shared-prompt forward. The layout reaches every attention layer through
        Hugging Face's forward keywords. A placeholder 4D mask is passed as-is (and ignored by the blockwise
        attention): otherwise Hugging Face would build an [L, L] mask from the restarting position ids that
        nothing reads."""
        return {
            "input_ids": shared.input_ids_1L,
            "position_ids": shared.position_ids_1L,
            "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=shared.input_ids_1L.device),
            "use_cache": False,
            "shared_prefix_layout": shared.layout,
        }

    def _logits(self, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """[B, T, V] float32 full-vocab logits of the sampling distribution (temperature, top-k, top-p; see
        ``nemo_rl.models.sampling.sampling_logits``). With ``policy.sequence_packing`` the rows run as one
        packed row and the logits are unpacked (zeros at padding); with ``policy.shared_prefix`` rows sharing a
        prompt hold it once in one packed row (:class:`SharedPrefixRows`) and the logits are mapped back."""
        packed = shared = None
        if self.cfg.packs_sequences:
            multiple = math.lcm(self.cfg.sequence_packing.sequence_length_round, self.seq_multiple)
            packed = PackedRows.pack(mb["input_ids"], mb["input_lengths"], multiple)
            # Hugging Face keeps attention within each packed sequence (restarting position ids) only when
            # no KV cache is passed: use_cache=False is what makes the packed forward exact.
            inputs = {
                "input_ids": packed.input_ids_1L,
                "position_ids": packed.position_ids_1L,
                "use_cache": False,
            }
        elif self.cfg.shared_prefix.enabled and (shared := self._shared_prefix_rows(mb)) is not None:
            inputs = self._shared_prefix_inputs(shared)
            if self.moe_routing.is_moe:
                # transformers' own load-balancing loss would read the placeholder mask as [B, T] and fail;
                # the worker computes that loss itself from the recorded routing (moe_step_terms).
                inputs["output_router_logits"] = False
        else:
            # A vision-language model also reads the rows' images (none for a text model's batch).
            images = image_forward_inputs(mb, self.device, **vlm_token_ids(self.model.config))
            inputs = {"input_ids": mb["input_ids"], "use_cache": False, **images}
        layout = packed or shared
        # Routing replay: the routers of this forward take the sampler's experts (policy.router_replay).
        with self.moe_routing.replaying(replay_rows(mb, layout) if self.cfg.router_replay.enabled else None):
            output = self.model(**inputs)
        self._fed_valid_N = (
            fed_token_mask(layout.index_BT, layout.valid_BT, output.logits.shape[1])
            if layout is not None
            else valid_token_mask(mb["input_lengths"].to(mb["input_ids"].device), mb["input_ids"].shape[1])
        ).reshape(-1)
        logits_BTV = output.logits
        from torch.distributed.tensor import DTensor

        if isinstance(logits_BTV, DTensor):  # a custom TP plan may leave the LM head's output sharded
            logits_BTV = logits_BTV.full_tensor()
        if packed is not None:
            logits_BTV = packed.unpack(logits_BTV)
        elif shared is not None:
            logits_BTV = shared.unpack(logits_BTV)
        generation = self.cfg.generation
        return sampling_logits(
            logits_BTV.float(), mb["input_ids"], generation.temperature, generation.top_k, generation.top_p
        )

    def _shared_prefix_rows(self, mb: BatchedDataDict[Any]) -> SharedPrefixRows | None:
        """``mb``'s rows packed with each shared prompt once, or None when no two rows share one (or the
        micro-batch has no ``token_mask`` to tell prompts from responses): then the plain forward runs."""
        if "token_mask" not in mb:
            return None
        prompts = prompt_lengths(mb["token_mask"], mb["input_lengths"])
        groups = shared_prefix_groups(mb["input_ids"], prompts)
        if len(groups) == mb.size:
            return None
        use_shared_prefix_attention(self.model)
        return SharedPrefixRows.build(
            mb["input_ids"], mb["input_lengths"], prompts, groups, self.seq_multiple
        )

    @torch.no_grad()
    def _score(
        self,
        data: BatchedDataDict[Any],
        fn: ScoreFn,
        micro_batch_size: int | None,
    ) -> BatchedDataDict[Any]:
        """Run ``fn(model output, micro_batch)`` over ``data`` in inference mode and merge its outputs.

        The model output is what :meth:`_forward` returns; ``fn``'s outputs are per token ([B, T, ...]) or
        per sequence ([B]).
        """
        if data.size == 0:
            raise ValueError("every data-parallel rank needs at least one sequence to score")
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        batch = pad_sequence_dim(data, self.seq_multiple)
        self.model.eval()
        outputs = [
            (rows, fn(self._forward(mb), mb))
            for rows, mb in self._micro_batches(batch, mbs, self._mb_tokens(train=False))
        ]
        reshard_all(self.model)
        return merge_rows(outputs, data.size, int(data["input_ids"].shape[1]))

    def _micro_batch_options(self) -> dict[str, Any]:
        return {
            "packing": self.cfg.sequence_packing if self.cfg.packs_sequences else None,
            "shared_prefix": self.cfg.shared_prefix.enabled,
        }

    def _mb_tokens(self, train: bool) -> int:
        """The token budget of a training or scoring micro-batch (packing's, or dynamic batching's)."""
        cfg = self.cfg
        if not cfg.packs_sequences:
            return cfg.dynamic_batching.train_mb_tokens if train else cfg.dynamic_batching.logprob_mb_tokens
        packing = cfg.sequence_packing
        if train:
            budget = packing.train_mb_tokens
            rows = cfg.train_micro_batch_size
        else:
            budget = packing.logprob_mb_tokens
            rows = cfg.logprob_batch_size or cfg.train_micro_batch_size
        # NeMo RL's recipes derive the budgets from the padded micro-batch they replace.
        return budget if budget is not None else cfg.max_total_sequence_length * rows

    # ---------------------------------------------------------------------------------------- training
    def _forward_backward(
        self, step: StepBatch, loss_fn: LossFunction, eval_mode: bool
    ) -> tuple[float, list[dict[str, Any]]]:
        """The step's micro-batches, forward and (training) backward, gradients synced on the last one."""
        if not eval_mode:
            self.optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        mb_metrics: list[dict[str, Any]] = []
        max_tokens = self._mb_tokens(train=True)
        batches = list(self._micro_batches(step.batch, step.micro_batch_size, max_tokens))
        for index, (_, mb) in enumerate(batches):
            if not eval_mode:
                self._defer_gradient_sync(last_micro_batch=index == len(batches) - 1)
            with torch.set_grad_enabled(not eval_mode):
                loss, metrics = self._loss_with_moe_terms(mb, loss_fn, step)
                if not eval_mode:
                    loss.backward()
            step_loss += float(loss.detach().double())
            mb_metrics.append(metrics)
        return step_loss, mb_metrics

    def _loss_with_moe_terms(
        self, mb: BatchedDataDict[Any], loss_fn: LossFunction, step: StepBatch
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``loss_fn`` on the micro-batch's forward; for a MoE model plus the load-balancing loss (when the
        config asks for it) and the routing metrics, weighted by the micro-batch's share of the loss tokens."""
        if not self.moe_routing.is_moe:
            return loss_fn(self._forward(mb), mb, step.global_valid_seqs, step.global_valid_toks)
        with self.moe_routing.record() as routing:
            output = self._forward(mb)
        loss, metrics = loss_fn(output, mb, step.global_valid_seqs, step.global_valid_toks)
        valid_N = self._fed_valid_N.to(output.device)
        # The micro-batch's share of the step's loss tokens: the shares of a step sum to 1, so the trained term
        # is the token-weighted mean of the micro-batches' losses (one micro-batch: transformers' own).
        share = float(global_valid_counts(mb)[1]) / max(float(step.global_valid_toks), 1.0)
        moe_loss, moe_metrics = moe_step_terms(self.moe_routing, routing, valid_N, share)
        return loss + moe_loss, {**metrics, **moe_metrics}

    def _optimizer_step(self, log: TrainLog) -> None:
        """Sum the replicated gradients, clip, then step unless the gradient norm is not finite."""
        self._all_reduce_replicated_grads()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        log.add_update(grad_norm, float(self.optimizer.param_groups[0]["lr"]))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            # A skipped step leaves the schedule where it was, as it leaves the weights.
            self.scheduler.step()
        else:
            logger.warning("skipping the optimizer step: the gradient norm is %s", grad_norm)

    def _after_eval_step(self) -> None:
        reshard_all(self.model)

    def _all_reduce_replicated_grads(self) -> None:
        """At DP>1, sum the gradients of the parameters every dp rank holds whole (all of them with
        ``data_parallel_mode=replicate``; under FSDP a vision-language model's vision tower) over the dp ranks
        with one all-reduce of one flat buffer (losses are globally normalised, so the step's gradient is the
        sum).

        Only trained parameters take part (``policy.frozen_parameters`` have no gradient and add no traffic).
        One that got no gradient on this rank (its forward did not reach it) adds zeros, so every rank's buffer
        has the same layout; the buffer ends with one "had a gradient" flag per parameter, and a parameter no
        rank reached keeps no gradient, so the optimizer skips it as it would in one process.
        """
        if self.dp_size == 1:
            return
        from torch.distributed.tensor import DTensor

        trained = [p for p in self.model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if not trained:
            return
        reached = [p.grad is not None for p in trained]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trained]
        flags = torch.tensor(reached, dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        summed_flags = flat[-len(trained) :].tolist()
        for p, g, reached_anywhere in zip(trained, grads, summed_flags, strict=True):
            if reached_anywhere:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                p.grad = g
            offset += g.numel()

    def _defer_gradient_sync(self, last_micro_batch: bool) -> None:
        """On CPU, reduce the gradients and reshard the parameters after the step's last micro-batch only.

        FSDP otherwise reduce-scatters every micro-batch's gradients and all-gathers the parameters again for
        the next one. On CPU the full parameters and gradients fit in host memory, and every gloo collective
        takes compute time from the ranks, so the step then costs one all-gather and one reduce-scatter per
        layer, as DDP's one all-reduce. The summed gradients are the same (up to float rounding order).
        """
        if self.device.type != "cpu":
            return
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last_micro_batch)
            self.model.set_reshard_after_backward(last_micro_batch)

    # --------------------------------------------------------------------------- memory / placement
    def _move_optimizer_state(self, device: torch.device | str) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # Adam's step counters stay where the optimizer created them (host scalars).
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    def _move_model(self, device: torch.device | str) -> None:
        if not self.cfg.dtensor_cfg.cpu_offload:  # with CPU offload, FSDP owns where the shards live
            reshard_all(self.model)
            # A CPU worker's weights never leave the host, and walking the model to move nothing costs
            # milliseconds a refit.
            if self.device.type != "cpu":
                self.model.to(device)

    def _release_device_memory(self) -> None:
        if cuda_available():
            torch.cuda.empty_cache()

    def prepare_for_training(self) -> None:
        """Weights and optimizer state onto the device; training mode."""
        self._move_model(self.device)
        self._move_optimizer_state(self.device)
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        """Weights onto the device, optimizer state to the host; inference mode."""
        self._move_model(self.device)
        self.model.eval()
        self.offload_before_refit()

    def offload_before_refit(self) -> None:
        """Optimizer state to the host, so the refit's gather buffers fit on the device."""
        self._move_optimizer_state("cpu")
        self._release_device_memory()

    def offload_after_refit(self) -> None:
        """Weights and optimizer state to the host, leaving the device to colocated generation."""
        self._move_model("cpu")
        self._move_optimizer_state("cpu")
        self._release_device_memory()

    def shutdown(self) -> None:
        """Drop the model, optimizer and reference weights (the process group goes with the process)."""
        reshard_all(self.model)
        del self.model, self.optimizer, self.scheduler
        self.reference_shards = None
        self._release_device_memory()
