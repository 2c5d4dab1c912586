"""The math environment: reward 1 when the response's final answer matches the ground truth, else 0.

Single turn: every response is final (``terminated``). Two checks (``env.math.math_verify_impl``):

- ``hf_math_verify``: the last ``\\boxed{}`` answer, checked by math-verify in a pool of verifier processes
  (``env.math.num_workers``), each answer within ``env.math.verify_timeout_s``; an answer that takes longer
  scores 0 and cannot stall the step (see :mod:`nemo_rl.environments.verifier_pool`).
- ``dapo_math_verify``: DAPO's rule, the last ``Answer:`` line compared as normalised text
  (:mod:`nemo_rl.environments.dapo_math_verifier`), decided in the environment itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from nemo_rl.config.env import MathEnvConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.dapo_math_verifier import score_dapo_response
from nemo_rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    check_ground_truths,
    check_step_batch,
)
from nemo_rl.environments.math_verifier import (
    extract_last_boxed,
    gold_answer,
    quick_verdict,
    score_math_response,
)
from nemo_rl.environments.metrics import (
    assistant_text,
    batch_rewards,
    group_ids,
    last_assistant_text,
    pass_at_samples,
)
from nemo_rl.environments.verifier_pool import VerifierPool, VerifyOutcome

MathMetadata = dict[str, Any]
"""Per-sample state: ``ground_truth`` (from the dataset); each step adds ``extracted_answer`` and
``verify_timed_out``."""


@ray.remote
class MathEnvironment(EnvironmentInterface[MathMetadata]):
    """Scores math responses with math-verify or DAPO's rule (a Ray actor: ``MathEnvironment.remote(cfg)`` or
    ``create_env``).

    Args:
        cfg: The ``env.math`` section (a plain dict in NeMo RL's shape is accepted too).
    """

    def __init__(self, cfg: MathEnvConfig | Mapping[str, Any]) -> None:
        self.cfg = cfg if isinstance(cfg, MathEnvConfig) else MathEnvConfig.model_validate(dict(cfg))
        # math-verify and sympy are imported and warmed up once, in the verifier processes' fork server;
        # this actor decides only certain verdicts and never imports them. The processes start with the first
        # answer a certain verdict does not settle: their start then does not compete with the policy
        # workers' start, and the first such answer waits for it once (benchmarks/README.md, "Time to the
        # first step"). Under dapo_math_verify the pool is never used, so its processes never start.
        self._pool = VerifierPool(
            score_math_response,
            num_workers=self.cfg.num_workers,
            timeout_s=self.cfg.verify_timeout_s,
            memory_limit_mb=self.cfg.verify_memory_limit_mb,
            max_response_chars=self.cfg.max_response_chars,
            preload=["nemo_rl.environments.math_verifier_warm_up"],
            start_on_first_use=True,
        )
        self.num_quick_verdicts = 0
        """Answers scored without math-verify (see ``quick_verdict``) since the environment started."""

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[MathMetadata]
    ) -> EnvironmentReturn[MathMetadata]:
        """Score the last assistant message of each conversation against its ``ground_truth``."""
        check_step_batch(message_log_batch, metadata)
        check_ground_truths(metadata, "math", "the math data processor puts the expected answer there")
        responses = [last_assistant_text(log) for log in message_log_batch]
        ground_truths = [str(m["ground_truth"]) for m in metadata]
        if self.cfg.math_verify_impl == "dapo_math_verify":
            outcomes = self._dapo_outcomes(responses, ground_truths)
        else:
            outcomes = self._math_verify_outcomes(responses, ground_truths)
        answers = [o.answer for o in outcomes]
        rewards = [o.score for o in outcomes]
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": f"Environment: {'correct' if r > 0 else 'incorrect'}"}
                for r in rewards
            ],
            metadata=[
                {**m, "extracted_answer": a, "verify_timed_out": o.timed_out}
                for m, a, o in zip(metadata, answers, outcomes, strict=True)
            ],
            next_stop_strings=[self.cfg.stop_strings] * len(responses),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(responses), dtype=torch.bool),
            answers=answers,
        )

    def _dapo_outcomes(self, responses: list[str], ground_truths: list[str]) -> list[VerifyOutcome]:
        """DAPO's string comparison of ``Answer:`` lines: string operations on a few hundred characters
        each, decided here (no verifier process)."""
        self.num_quick_verdicts += len(responses)
        return [
            VerifyOutcome(score=score, answer=answer)
            for score, answer in map(score_dapo_response, responses, ground_truths)
        ]

    def _math_verify_outcomes(self, responses: list[str], ground_truths: list[str]) -> list[VerifyOutcome]:
        """The last boxed answers checked by math-verify, the certain verdicts decided here."""
        # Certain verdicts (no answer, the same text, two integers) are decided here, on the same cut of the
        # response the verifiers see (extraction is linear in it); only the rest pay for a verifier process
        # and math-verify, which also extracts their answers under its time and memory limits.
        cap = self.cfg.max_response_chars
        quick_answers = [extract_last_boxed(r if cap is None else r[-cap:]) for r in responses]
        quick = [quick_verdict(a, gold_answer(t)) for a, t in zip(quick_answers, ground_truths, strict=True)]
        undecided = [i for i, verdict in enumerate(quick) if verdict is None]
        self.num_quick_verdicts += len(quick) - len(undecided)
        verified = iter(
            self._pool.verify([responses[i] for i in undecided], [ground_truths[i] for i in undecided])
            if undecided
            else []
        )
        return [
            VerifyOutcome(score=v, answer=a) if v is not None else next(verified)
            for v, a in zip(quick, quick_answers, strict=True)
        ]

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Accuracy, pass@(samples per prompt), response lengths and verifier timeouts of a finished batch.

        Reads ``total_reward`` (or ``rewards``), ``idx`` or ``message_log`` (to group samples by prompt) and,
        when present, ``message_log``, ``truncated`` and ``extra_env_info``. The batch is returned unchanged.
        """
        rewards_B = batch_rewards(batch)
        correct_B = rewards_B >= 1.0
        groups = group_ids(batch)
        metrics: dict[str, float] = {
            "accuracy": rewards_B.mean().item() if rewards_B.numel() else 0.0,
            "pass@samples_per_prompt": pass_at_samples(rewards_B, groups, threshold=1.0),
            "num_problems_in_batch": float(len(set(groups))),
            "num_samples": float(rewards_B.numel()),
        }
        if "message_log" in batch:
            lengths_B = torch.tensor(
                [len(assistant_text(log)) for log in batch["message_log"]], dtype=torch.float32
            )
            metrics["mean_response_length_chars"] = lengths_B.mean().item() if lengths_B.numel() else 0.0
            metrics["correct_response_length_chars"] = (
                lengths_B[correct_B].mean().item() if correct_B.any() else 0.0
            )
        if "truncated" in batch:
            metrics["fraction_of_samples_properly_ended"] = (
                1.0 - torch.as_tensor(batch["truncated"]).float().mean().item()
            )
        if "extra_env_info" in batch:
            infos = [info for info in batch["extra_env_info"] if isinstance(info, Mapping)]
            if infos:
                metrics["verify_timeout_fraction"] = sum(
                    bool(i.get("verify_timed_out")) for i in infos
                ) / len(infos)
        return batch, metrics

    def verifier_stats(self) -> dict[str, int]:
        """Answers that timed out, verifier processes replaced and answers scored without math-verify
        (``num_quick_verdicts``) since the environment started."""
        return {
            "num_timeouts": self._pool.num_timeouts,
            "num_restarts": self._pool.num_restarts,
            "num_quick_verdicts": self.num_quick_verdicts,
        }

    def shutdown(self) -> None:
        """Stop the verifier processes."""
        self._pool.close()
