"""Collate functions: RL prompt batches and SFT training tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.data.collate_fn import (
    make_preference_collate_fn,
    make_sft_collate_fn,
    preference_collate_fn,
    rl_collate_fn,
    sft_collate_fn,
)
from nemo_rl.data.interfaces import ChatMessage, DatumSpec, Record, TaskDataSpec
from nemo_rl.data.llm_message_utils import message_log_token_ids
from nemo_rl.data.processors import math_processor, preference_processor, sft_processor
from nemo_rl.data.tiny import build_tiny_tokenizer, generate_arithmetic_problems
from nemo_rl.models.tokenizer import get_tokenizer

SPEC = TaskDataSpec(
    task_name="math", prompt=None, system_prompt=None, add_bos=True, add_eos=True, add_generation_prompt=True
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return get_tokenizer(TokenizerConfig(name=str(path)), model_name=None, trust_remote_code=False)


def _records(num: int) -> list[Record]:
    return [
        Record(
            messages=[
                ChatMessage(role="user", content=row["problem"]),
                ChatMessage(role="assistant", content=row["generated_solution"]),
            ],
            expected_answer=row["expected_answer"],
        )
        for row in generate_arithmetic_problems(num, seed=0)
    ]


def test_rl_collate(tokenizer: PreTrainedTokenizerBase) -> None:
    records = _records(3)
    records[2]["messages"][0]["content"] = "x" * 200
    batch_in = [math_processor(r, SPEC, tokenizer, 64, i) for i, r in enumerate(records)]
    batch = rl_collate_fn(batch_in)
    assert batch.size == 3
    assert set(batch) == {"message_log", "extra_env_info", "task_name", "idx", "length", "loss_multiplier"}
    assert batch["message_log"][1] is batch_in[1]["message_log"]
    assert batch["extra_env_info"] == [{"ground_truth": r["expected_answer"]} for r in records]
    assert batch["task_name"] == ["math"] * 3
    assert batch["idx"].tolist() == [0, 1, 2] and batch["idx"].dtype == torch.long
    assert batch["length"].tolist() == [d["length"] for d in batch_in]
    assert batch["loss_multiplier"].tolist() == [1.0, 1.0, 0.0]
    assert batch["loss_multiplier"].dtype == torch.float32
    with pytest.raises(ValueError, match="empty batch"):
        rl_collate_fn([])
    # Samples may carry the stop strings of their first response (None where one has none).
    batch_in[0]["stop_strings"] = ["</action>"]
    assert rl_collate_fn(batch_in)["stop_strings"] == [["</action>"], None, None]


def test_sft_collate_shapes_and_masks(tokenizer: PreTrainedTokenizerBase) -> None:
    batch_in = [sft_processor(r, SPEC, tokenizer, 64, i) for i, r in enumerate(_records(4))]
    collate = make_sft_collate_fn(tokenizer, max_seq_length=64)
    batch = collate(batch_in)
    lengths = [d["length"] for d in batch_in]
    assert set(batch) == {"input_ids", "input_lengths", "token_mask", "sample_mask", "idx"}
    assert batch["input_ids"].shape == batch["token_mask"].shape == (4, max(lengths))
    assert batch["input_ids"].dtype == torch.long and batch["input_lengths"].dtype == torch.long
    assert batch["input_lengths"].tolist() == lengths
    assert batch["sample_mask"].tolist() == [1.0] * 4
    for row, datum in enumerate(batch_in):
        n = lengths[row]
        assert torch.equal(batch["input_ids"][row, :n], message_log_token_ids(datum["message_log"]))
        assert batch["input_ids"][row, n:].eq(tokenizer.pad_token_id).all()
        trained = batch["input_ids"][row][batch["token_mask"][row].bool()].tolist()
        solution = datum["message_log"][-1]["content"]
        assert tokenizer.decode(trained) == solution and solution.endswith("}<|eos|>")


def test_sft_collate_truncates(tokenizer: PreTrainedTokenizerBase) -> None:
    long_record = Record(
        messages=[ChatMessage(role="user", content="q" * 30), ChatMessage(role="assistant", content="a" * 30)]
    )
    batch_in: list[DatumSpec] = [
        sft_processor(long_record, SPEC, tokenizer, 40, 0),
        sft_processor(_records(1)[0], SPEC, tokenizer, 40, 1),
    ]
    assert batch_in[0]["length"] > 40
    batch = sft_collate_fn(batch_in, pad_token_id=tokenizer.pad_token_id, max_seq_length=40)
    assert batch["input_ids"].shape[1] == 40
    assert batch["input_lengths"].tolist() == [40, batch_in[1]["length"]]
    # The truncated sample keeps its first assistant tokens and is still trained on.
    assert batch["token_mask"][0].sum().item() == 40 - (1 + 1 + 30 + 1)
    assert batch["sample_mask"].tolist() == [1.0, 1.0]
    # Cut before any assistant token, a sample has nothing to learn and is masked out.
    short = sft_collate_fn(batch_in, pad_token_id=tokenizer.pad_token_id, max_seq_length=20)
    assert short["sample_mask"].tolist() == [0.0, 1.0]
    assert short["token_mask"][0].sum().item() == 0


def _pair(chosen: str, rejected: str) -> Record:
    prompt = [ChatMessage(role="user", content="What is 1+2?")]
    return Record(
        messages=[*prompt, ChatMessage(role="assistant", content=chosen)],
        rejected_messages=[*prompt, ChatMessage(role="assistant", content=rejected)],
    )


def test_preference_collate_interleaves_pairs(tokenizer: PreTrainedTokenizerBase) -> None:
    pairs = [_pair("3", "four"), _pair("1+2=3", "2")]
    batch_in = [preference_processor(r, SPEC, tokenizer, 64, i + 10) for i, r in enumerate(pairs)]
    batch = make_preference_collate_fn(tokenizer, max_seq_length=64)(batch_in)
    assert batch["input_ids"].shape[0] == 4
    assert batch["idx"].tolist() == [10, 10, 11, 11]
    assert batch["sample_mask"].tolist() == [1.0] * 4
    responses = [
        tokenizer.decode(batch["input_ids"][row][batch["token_mask"][row].bool()].tolist())
        for row in range(4)
    ]
    assert responses == ["3<|eos|>", "four<|eos|>", "1+2=3<|eos|>", "2<|eos|>"]
    lengths = batch["input_lengths"].tolist()
    assert lengths[0] == batch_in[0]["length"] - 3 and lengths[1] == batch_in[0]["length"]
    with pytest.raises(ValueError, match="no rejected response"):
        preference_collate_fn(
            [sft_processor(_records(1)[0], SPEC, tokenizer, 64, 0)], pad_token_id=0, max_seq_length=64
        )
    with pytest.raises(ValueError, match="binary_preference"):
        preference_processor(_records(1)[0], SPEC, tokenizer, 64, 0)


def test_preference_collate_masks_whole_pairs(tokenizer: PreTrainedTokenizerBase) -> None:
    # The prompt is 1 + 1 + 12 + 1 tokens: at 16 the chosen "3" survives, the longer rejected too;
    # at 15 neither keeps an assistant token and the pair is masked as a whole.
    pairs = [_pair("3", "a much longer answer"), _pair("3", "4")]
    batch_in = [preference_processor(r, SPEC, tokenizer, 64, i) for i, r in enumerate(pairs)]
    kept = preference_collate_fn(batch_in, pad_token_id=tokenizer.pad_token_id, max_seq_length=16)
    assert kept["sample_mask"].tolist() == [1.0] * 4 and kept["input_ids"].shape[1] == 16
    cut = preference_collate_fn(batch_in, pad_token_id=tokenizer.pad_token_id, max_seq_length=15)
    assert cut["sample_mask"].tolist() == [0.0] * 4


def test_preference_collate_masks_ties(tokenizer: PreTrainedTokenizerBase) -> None:
    # A tie (HelpSteer3's overall_preference 0) pairs a response with itself: it teaches nothing.
    pairs = [_pair("3", "4"), _pair("same", "same"), _pair("same", "same but longer")]
    batch_in = [preference_processor(r, SPEC, tokenizer, 64, i) for i, r in enumerate(pairs)]
    batch = preference_collate_fn(batch_in, pad_token_id=tokenizer.pad_token_id, max_seq_length=64)
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
