"""The shared-prompt forward (``policy.shared_prefix``): groups found in the data, and logits and gradients
equal to the ordinary forward's (the worker-level parity over dp=2 is in tests/distributed/test_dtensor_worker.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.policy.shared_prefix import (
    SharedPrefixRows,
    identical_rows,
    prompt_lengths,
    shared_prefix_groups,
    shared_prefix_units,
    use_shared_prefix_attention,
)

SEQ_LEN = 12
# Rows 0-2 share a 3-token prompt, 4-5 a 4-token one; row 3 has a prompt of its own, row 6 no prompt at all
# (trained from its first token), row 7 no response (all prompt): groups of 3, 2 and three of 1.
LENGTHS = [7, 12, 5, 9, 6, 10, 4, 3]
PROMPTS = [3, 3, 3, 2, 4, 4, 0, 5]


def grouped_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lengths_B = torch.tensor(LENGTHS)
    ids_BT = torch.randint(1, 32, (len(LENGTHS), SEQ_LEN))
    ids_BT[1:3, :3] = ids_BT[0, :3]
    ids_BT[5, :4] = ids_BT[4, :4]
    positions = torch.arange(SEQ_LEN)[None, :]
    ids_BT *= positions < lengths_B[:, None]
    token_mask_BT = ((positions >= torch.tensor(PROMPTS)[:, None]) & (positions < lengths_B[:, None])).float()
    return ids_BT, lengths_B, token_mask_BT


def test_groups_are_rows_with_identical_prompts() -> None:
    ids_BT, lengths_B, token_mask_BT = grouped_batch()
    prompts = prompt_lengths(token_mask_BT, lengths_B)
    assert prompts == [3, 3, 3, 2, 4, 4, 0, 3]  # row 7: no trained token, so all of its 3 tokens
    assert shared_prefix_groups(ids_BT, prompts) == [[0, 1, 2], [3], [4, 5], [6], [7]]
    # A different token in the prompt makes another group, a different response does not.
    ids_BT[2, 1] += 1
    ids_BT[1, 5] += 1
    assert shared_prefix_groups(ids_BT, prompts)[:2] == [[0, 1], [2]]


def test_units_keep_groups_within_the_token_budget() -> None:
    ids_BT, lengths_B, token_mask_BT = grouped_batch()
    prompts = prompt_lengths(token_mask_BT, lengths_B)
    groups = shared_prefix_groups(ids_BT, prompts)
    # Segments: 3 + 4 + 9 + 2 = 18, 9, 4 + 2 + 6 = 12, 4, 3 tokens.
    assert shared_prefix_units(groups, LENGTHS, prompts, max_tokens=64) == (groups, [18, 9, 12, 4, 3])
    units, lengths = shared_prefix_units(groups, LENGTHS, prompts, max_tokens=12)
    assert units == [[0], [1], [2], [3], [4, 5], [6], [7]]  # row 1 (12 tokens) alone; 3 + 4 + 9 > 12
    assert lengths == [7, 12, 5, 9, 12, 4, 3]


@pytest.mark.parametrize("multiple", [1, 8])
def test_shared_forward_equals_the_unshared_forward(multiple: int) -> None:
    """Logits and the gradients of every weight, at every real position of every row."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config)
    ids_BT, lengths_B, token_mask_BT = grouped_batch()
    prompts = prompt_lengths(token_mask_BT, lengths_B)
    shared = SharedPrefixRows.build(
        ids_BT, lengths_B, prompts, shared_prefix_groups(ids_BT, prompts), multiple
    )
    # One packed row: the 56 tokens of the 8 rows less the repeated prompts (2 x 3 + 4), rounded up.
    assert shared.input_ids_1L.shape == (1, 46 if multiple == 1 else 48)
    weights_BTV = torch.randn(len(LENGTHS), SEQ_LEN, 32)
    valid_BT = shared.valid_BT

    def logits_and_grads(**inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits_BTV = model(use_cache=False, **inputs).logits
        if "shared_prefix_layout" in inputs:
            logits_BTV = shared.unpack(logits_BTV)
        (logits_BTV * weights_BTV)[valid_BT].sum().backward()
        return logits_BTV.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    expected, expected_grads = logits_and_grads(input_ids=ids_BT)
    use_shared_prefix_attention(model)
    actual, grads = logits_and_grads(
        input_ids=shared.input_ids_1L, position_ids=shared.position_ids_1L, shared_prefix_layout=shared.layout
    )
    torch.testing.assert_close(actual[valid_BT], expected[valid_BT], rtol=1e-5, atol=1e-5)
    assert (actual[~valid_BT] == 0).all()
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # Without a layout the model runs its ordinary sdpa attention.
    plain, _ = logits_and_grads(input_ids=ids_BT)
    torch.testing.assert_close(plain, expected, rtol=0, atol=0)


def test_identical_rows_run_once() -> None:
    ids = torch.tensor([[1, 2, 3, 0], [1, 2, 4, 0], [1, 2, 3, 9], [5, 6, 0, 0], [1, 2, 4, 0]])
    lengths = torch.tensor([3, 3, 3, 2, 3])  # row 2 equals row 0 up to its length
    mask = torch.tensor([[0, 1, 1, 0]] * 3 + [[0, 1, 0, 0]] + [[0, 0, 1, 0]])  # row 4: other trained tokens
    batch = {"input_ids": ids, "input_lengths": lengths, "token_mask": mask}
    unique, copies = identical_rows(batch)
    assert unique == [0, 1, 3, 4]
    assert copies.tolist() == [0, 1, 0, 2, 3]
    assert identical_rows({**batch, "input_ids": torch.arange(20).reshape(5, 4)})[0] is None


def test_shared_prefix_is_refused_where_it_is_not_built() -> None:
    def cfg(**overrides: Any) -> PolicyConfig:
        return PolicyConfig.model_validate(
            {"model_name": "unused", "shared_prefix": {"enabled": True}, **overrides}
        )

    assert cfg(dynamic_batching={"enabled": True}).shared_prefix.enabled
    with pytest.raises(ValueError, match="pick one"):
        cfg(sequence_packing={"enabled": True})
    assert cfg(reward_model_cfg={"enabled": True}).shared_prefix.enabled
    with pytest.raises(ValueError, match="DTensor backend only"):
        cfg(dtensor_cfg={"enabled": False}, megatron_cfg={"enabled": True}, optimizer=None)
    eager = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
        )
    )
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="needs full attention through the sdpa"):
        use_shared_prefix_attention(eager)
