"""One replica of the embedded engine, run as a Ray actor by :class:`~nemo_rl.distributed.worker_groups.RayWorkerGroup`.

Each worker holds the whole model in the generation dtype (``policy.generation.embedded_cfg.precision``) on its
device and generates for the shard of the batch it is handed; replicas never talk to each other, so the
worker joins no default process group (the collective refit transport builds its own).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.device import configure_worker_threads, get_device
from nemo_rl.models.generation.embedded.replica import EmbeddedReplica
from nemo_rl.models.generation.embedded.vision import load_decoder
from nemo_rl.models.hf_decoder import resolve_checkpoint_dir
from nemo_rl.models.tokenizer import require_pad_token_id
from nemo_rl.weight_sync.checksums import Checksum
from nemo_rl.weight_sync.interfaces import TransferStats, WeightReceiver
from nemo_rl.weight_sync.manifest import dtype_from_name
from nemo_rl.weight_sync.scope import RefitScope

logger = logging.getLogger(__name__)


class EmbeddedGenerationWorker(EmbeddedReplica):
    """A Ray actor running one :class:`~.replica.EmbeddedReplica` (the whole model, loaded from a checkpoint).

    Args:
        cfg: the ``policy`` section (model, sampling settings, generation dtype, sequence limits).
        tokenizer: for the pad and EOS ids and for decoding stop strings.
        model_path: a local Hugging Face checkpoint folder overriding ``cfg.model_name`` (e.g. an exported
            policy checkpoint); ``None`` loads ``cfg.model_name``.
    """

    def __init__(self, cfg: PolicyConfig, tokenizer: PreTrainedTokenizerBase, model_path: str | None = None):
        configure_worker_threads()
        require_pad_token_id(tokenizer)
        device = get_device()
        dtype = dtype_from_name(cfg.generation.embedded_cfg.precision)
        checkpoint_dir = resolve_checkpoint_dir(model_path or cfg.model_name)
        model = load_decoder(
            checkpoint_dir, dtype=dtype, device=device, config_overrides=cfg.hf_config_overrides
        )
        super().__init__(
            cfg,
            tokenizer,
            model,
            checkpoint_dir=checkpoint_dir,
            dp_rank=int(os.environ.get("NEMO_RL_DP_RANK", "0")),
            device=device,
        )
        self.dtype = dtype
        self._in_flight = False
        logger.info(
            "embedded generation replica %d: %s, %.1f MB of %s weights on %s",
            self.dp_rank,
            self.model.arch.model_type,
            self.model.num_weight_bytes / 1e6,
            self.dtype,
            self.device,
        )

    def refit_receive(self, receiver: WeightReceiver, scope: RefitScope = "full") -> TransferStats:
        """The generation side of a refit of ``scope``: receive, check and load the weights
        (``nemo_rl.weight_sync``; with LoRA the adapters are merged first, see :meth:`merged_stream`). With
        in-flight updates on, weights that arrive while the worker generates are applied between two decode
        steps (see :meth:`enable_in_flight_weight_updates`)."""

        def load(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
            if self._in_flight:
                self.engine.load_weights(self.merged_stream(named_tensors, scope))
            else:
                self.load_hf_weights(named_tensors, scope)

        return receiver.receive(load, self.expected_weights_manifest(scope))

    def weight_checksums(self) -> dict[str, Checksum] | None:
        """The refit guard's checksums (:meth:`EmbeddedReplica.weight_checksums`); ``None`` with in-flight
        updates on, where a refit's weights may still be staged for the next decode step."""
        return None if self._in_flight else super().weight_checksums()

    def enable_in_flight_weight_updates(self, recompute_kv_cache: bool) -> None:
        """Let refits (run in a second thread of this actor) reach the engine while it decodes: they are
        staged and applied between two decode steps, with the running rows' KV cache recomputed when
        ``recompute_kv_cache``."""
        self._in_flight = True
        self.engine.recompute_kv_cache = recompute_kv_cache

    def shutdown(self) -> None:
        """Free the cache and the weights."""
        self.engine.release_cache()
