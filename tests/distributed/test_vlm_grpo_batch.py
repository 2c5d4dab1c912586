"""GRPO's data path with images, from prompts to the DTensor worker, on the tiny Qwen2.5-VL.

Prompts of ``tiny_clevr`` are repeated into groups and rolled out by a scripted generation backend that
answers from the images it is handed (so a row given another row's images answers wrongly), scored by the
counting verifier, and built into the training batch. Two FSDP2 ranks and one rank then score that batch:
their log-probs of every prompt-and-response row equal transformers' forward with the processor's inputs, and
one clipped policy-gradient step on it gives the same loss on both layouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from test_vlm_worker import hf_logprobs
from transformers import Qwen2_5_VLForConditionalGeneration

from nemo_rl.algorithms.advantages import compute_advantages
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl.config.data import DataConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.loss import ClippedPGLossConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import repeat_prompts, rl_collate_fn
from nemo_rl.data.vlm import load_hf_processor
from nemo_rl.data.vlm_prompts import setup_vlm_rl_data
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.registry import create_env
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.experience.train_batch import build_train_batch
from nemo_rl.models.tokenizer import get_policy_tokenizer

MODEL = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_qwen25vl_init"
NUM_PROMPTS = 4
GROUP = 2
MAX_LEN = 96
TIMEOUT_S = 300.0


class ImageReadingGeneration:
    """Answers each row from the image it is handed: the right count for the group's first sample, one more
    for the second (so each group has a reward of 1 and one of 0)."""

    def __init__(self, tokenizer: Any, counts: dict[int, int]) -> None:
        self.tokenizer = tokenizer
        self.counts = counts
        """The true count of each prompt, by the id of its ``pixel_values`` tensor."""

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        rows = []
        for b, (ids, length) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            count = self.counts[id(data["pixel_values"][b])] + b % GROUP
            reply = self.tokenizer.encode(f"\\boxed{{{count}}}", add_special_tokens=False)
            rows.append((ids[: int(length)], torch.tensor([*reply, self.tokenizer.eos_token_id])))
        width = max(len(p) + len(r) for p, r in rows)
        out = BatchedDataDict[Any](
            output_ids=torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long),
            logprobs=torch.zeros(len(rows), width),
            generation_lengths=torch.tensor([len(r) for _, r in rows]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(r) for p, r in rows]),
            truncated=torch.zeros(len(rows), dtype=torch.bool),
        )
        for b, (prompt, reply) in enumerate(rows):
            out["output_ids"][b, : len(prompt) + len(reply)] = torch.cat([prompt, reply])
            out["logprobs"][b, len(prompt) : len(prompt) + len(reply)] = -0.5
        return out


@pytest.fixture(scope="module")
def grpo_batch(ray_cluster: Any) -> tuple[BatchedDataDict[Any], Any]:
    """The training batch of one GRPO step on ``NUM_PROMPTS`` pictures, and its rollout (the in-driver
    environment's answers travel as Ray object refs, hence the cluster)."""
    policy = PolicyConfig(model_name=str(MODEL))
    tokenizer = get_policy_tokenizer(policy)
    data_cfg = DataConfig(dataset_name="tiny_clevr", num_train_samples=NUM_PROMPTS, num_val_samples=0)
    train, _ = setup_vlm_rl_data(
        data_cfg, tokenizer, load_hf_processor(policy), max_total_sequence_length=MAX_LEN
    )
    prompts = rl_collate_fn([train[i] for i in range(NUM_PROMPTS)])
    counts = {
        id(p): int(info["ground_truth"])
        for p, info in zip(prompts["pixel_values"], prompts["extra_env_info"], strict=True)
    }
    env = create_env("tiny_clevr", EnvConfig(), in_driver=True)
    rollout, _ = run_multi_turn_rollout(
        ImageReadingGeneration(tokenizer, counts),  # type: ignore[arg-type]
        repeat_prompts(prompts, GROUP),
        tokenizer,
        {"tiny_clevr": env},
        max_seq_len=MAX_LEN,
        max_rollout_turns=1,
    )
    advantages_B = compute_advantages(
        rollout["total_reward"], group_size=GROUP, use_leave_one_out_baseline=False, normalize_rewards=True
    )
    batch = build_train_batch(rollout, advantages_B, int(tokenizer.pad_token_id), overlong_filtering=False)
    batch["prev_logprobs"] = torch.zeros_like(batch["generation_logprobs"])
    return batch, rollout


def test_rollout_hands_each_row_its_images_and_scores_the_counts(grpo_batch: tuple[Any, Any]) -> None:
    batch, rollout = grpo_batch
    assert rollout["total_reward"].tolist() == [1.0, 0.0] * NUM_PROMPTS
    assert batch["input_ids"].shape[0] == NUM_PROMPTS * GROUP
    assert [p is rollout["pixel_values"][i] for i, p in enumerate(batch["pixel_values"])] == [True] * 8
    # The response follows the prompt's image placeholders; only its tokens are trained on.
    image_token_id = json.loads((MODEL / "config.json").read_text())["image_token_id"]
    placeholders_BT = batch["input_ids"] == image_token_id
    assert bool(placeholders_BT.any(dim=1).all()) and not bool(
        (placeholders_BT & (batch["token_mask"] > 0)).any()
    )
    assert float(batch["token_mask"].sum()) == float(rollout["generated_tokens"].sum())


def _score_and_train(save: SaveFn, batch_path: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    data = torch.load(batch_path, weights_only=False)
    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(MODEL),
            "train_global_batch_size": NUM_PROMPTS * GROUP,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 2,
            "max_total_sequence_length": MAX_LEN,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
        }
    )
    worker = DTensorPolicyWorker(cfg)
    save("logprobs", worker.get_logprobs(data)["logprobs"])
    shard = data.shard_by_batch_size(worker.dp_size, batch_size=NUM_PROMPTS * GROUP)[worker.dp_rank]
    save("train", worker.train(shard, ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))))
    worker.shutdown()


@pytest.fixture(scope="module")
def results(grpo_batch: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("vlm_grpo_results")
    batch_path = out_dir / "batch.pt"
    torch.save(grpo_batch[0], batch_path)
    run_groups(
        [("dp2", 2, _score_and_train), ("one", 1, _score_and_train)], batch_path, out_dir, timeout_s=TIMEOUT_S
    )
    return out_dir


def test_logprobs_of_prompt_and_response_rows_equal_transformers(
    results: Path, grpo_batch: tuple[Any, Any]
) -> None:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(MODEL)
    expected = hf_logprobs(model, grpo_batch[0])
    for group in ("dp2", "one"):
        torch.testing.assert_close(load(results, f"{group}.logprobs"), expected, rtol=1e-5, atol=1e-5)


def test_a_policy_gradient_step_on_image_rows_is_the_same_on_two_ranks(results: Path) -> None:
    dp2, one = load(results, "dp2.train"), load(results, "one.train")
    assert torch.isfinite(one["loss"]).all()
    torch.testing.assert_close(dp2["loss"], one["loss"], rtol=1e-5, atol=1e-6)
