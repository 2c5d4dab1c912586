"""Routing replay (``policy.router_replay``) on the tiny MoE checkpoints, without Ray: the embedded engine
records the experts ``transformers`` routes the same tokens to (through its deduplicated prefill and cache
compaction), replaying a policy's own routing changes nothing (bit for bit) and trains the router, a bfloat16
sampler's routing replayed in the float32 forward lowers the sampler/policy mismatch, and the routing travels
through message logs, the training batch and the packed layouts."""

from __future__ import annotations

import pytest
import torch
from test_moe_models import ASSETS, hf_model
from transformers import PreTrainedModel

from nemo_rl.config.master import SFTMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.interfaces import LLMMessage, MessageLog
from nemo_rl.data.routed_experts import ROUTED_EXPERTS_KEY
from nemo_rl.data.tiny_moe import MOE_FAMILIES
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.rollout_tokens import RolloutTokens
from nemo_rl.experience.train_batch import build_train_batch
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.hf_decoder import decoder_arch
from nemo_rl.models.policy.moe import RouterRecorder, replay_rows
from nemo_rl.models.policy.utils import PackedRows

PAD = 0


def engine_for(hf: PreTrainedModel, dtype: torch.dtype) -> EmbeddedEngine:
    model = DecoderLM(decoder_arch(hf.config), dtype=dtype)
    model.load_weights(hf.state_dict().items())
    engine = EmbeddedEngine(model, pad_token_id=PAD, max_sequence_length=64, decode_fn=None)
    engine.record_routing = True
    return engine


def params(max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset()) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids, stop_strings=(),
    )  # fmt: skip


def own_routing(hf: PreTrainedModel, ids_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T, L, K]``: the experts ``hf`` routes every token of ``ids_BT`` to."""
    recorder = RouterRecorder(hf)
    with torch.no_grad(), recorder.record() as record:
        hf(ids_BT)
    return torch.stack(record.experts_NK, dim=1).view(*ids_BT.shape, len(record.experts_NK), -1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_records_the_routing_transformers_computes(family: str) -> None:
    """Repeated prompts (one prefill each), rows stopping early (cache compaction): every recorded token's
    top-k set is the one ``transformers`` routes it to; tokens no forward ran are -1."""
    hf = hf_model(family, 0.25)
    engine = engine_for(hf, torch.float32)
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 104, (4, 9), generator=gen).repeat_interleave(3, dim=0)
    lengths = torch.tensor([9, 6, 4, 7]).repeat_interleave(3)
    stops = frozenset(range(3, 23))  # about a fifth of the vocabulary: rows finish at different steps
    out = engine.generate(prompts, lengths, params(24, stops), greedy=False, seed=1)
    routed = out.routed_experts
    assert routed is not None and routed.dtype == torch.int16
    assert int((out.generation_lengths < 24).sum()) >= 3  # some rows stopped: the cache was compacted
    expected = own_routing(hf, out.output_ids)
    positions = torch.arange(out.output_ids.shape[1])[None, :]
    ran = positions < (out.unpadded_sequence_lengths - 1)[:, None]  # every token but each row's last
    assert bool((routed[ran] >= 0).all()) and bool((routed[~ran & (positions > 0)][..., 0] < 0).any())
    assert bool((routed[positions >= out.unpadded_sequence_lengths[:, None]] == -1).all())
    recorded = routed[..., 0] >= 0
    assert torch.equal(routed[recorded].long().sort(dim=-1)[0], expected[recorded].sort(dim=-1)[0])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_own_routing_is_exact_and_trains_the_router(family: str) -> None:
    hf = hf_model(family, 0.25)
    ids = torch.randint(3, 104, (3, 20), generator=torch.Generator().manual_seed(4))
    routed_BTLK = own_routing(hf, ids)
    routed_BTLK[1, 5:] = -1  # unrecorded tokens keep the router's own choice
    recorder = RouterRecorder(hf)
    with torch.no_grad():
        plain = hf(ids).logits
    with recorder.replaying(routed_BTLK.flatten(0, 1)):
        replayed = hf(ids).logits
    assert torch.equal(plain, replayed.detach())
    replayed.logsumexp(-1).mean().backward()
    gate = next(m for n, m in hf.named_modules() if n.endswith("mlp.gate") and hasattr(m, "weight"))
    assert gate.weight.grad is not None and float(gate.weight.grad.abs().sum()) > 0


def k3(sampler_N: torch.Tensor, policy_N: torch.Tensor) -> float:
    d = policy_N - sampler_N
    return float((d.exp() - 1 - d).mean())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bfloat16_routing_replayed_lowers_the_mismatch(family: str) -> None:
    """GRPO's ``gen_kl_error`` (k3 over the sampled tokens) between a bfloat16 sampler and the float32
    policy, with and without the sampler's routing replayed (``docs/algorithms/moe.md``)."""
    hf = hf_model(family)
    engine = engine_for(hf, torch.bfloat16)
    prompts = torch.randint(3, 104, (48, 8), generator=torch.Generator().manual_seed(5))
    out = engine.generate(prompts, torch.full((48,), 8), params(32), greedy=False, seed=2)
    assert out.routed_experts is not None
    ids = out.output_ids
    sampled = torch.zeros_like(ids, dtype=torch.bool)
    sampled[:, 8:] = True
    recorder = RouterRecorder(hf)
    with torch.no_grad():
        plain = torch.log_softmax(hf(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        with recorder.replaying(out.routed_experts.flatten(0, 1)):
            logits = hf(ids).logits
        replayed = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    sampler = out.logprobs[:, 1:][sampled[:, 1:]]
    before, after = k3(sampler, plain[sampled[:, 1:]]), k3(sampler, replayed[sampled[:, 1:]])
    print(f"{family}: k3 {before:.3e} -> {after:.3e} with replay")
    assert after < 0.7 * before


def test_routing_travels_through_rollout_tensors_batch_and_packing() -> None:
    """A two-turn conversation: the observation takes the second call's prefill, the first response keeps its
    own routing but gets its last token from that prefill; the batch and a packed forward lay it out by
    token."""
    base = torch.arange(2 * 10 * 2 * 2, dtype=torch.int16).view(2, 10, 2, 2) % 8
    first = torch.where(torch.arange(10)[None, :, None, None] < 5, base, -1)  # last token (5), padding
    second = torch.where(torch.arange(10)[None, :, None, None] < 8, (base + 1) % 8, -1)
    log: MessageLog = [LLMMessage(role="user", content="a", token_ids=torch.arange(3))]
    short: MessageLog = [LLMMessage(role="user", content="e", token_ids=torch.arange(2))]
    tokens = RolloutTokens.from_prompts([log, short], PAD)

    def output(routed: torch.Tensor) -> BatchedDataDict:
        ids = torch.arange(10)[None, :] + 1
        return BatchedDataDict(output_ids=ids, logprobs=-ids.float() / 10, routed_experts=routed[:1])

    tokens.append_generated([0], output(first), torch.tensor([3]))  # one row sampled: the other is done
    tokens.append(0, torch.arange(1))
    assert tokens.generation_input([0])["input_lengths"].tolist() == [7]
    tokens.append_generated([0], output(second), torch.tensor([2]))
    rollout = BatchedDataDict(
        message_log=[log, short], loss_multiplier=torch.ones(2), truncated=torch.zeros(2, dtype=torch.bool)
    )
    rollout.update(tokens.batch_fields())
    batch = build_train_batch(rollout, torch.zeros(2), PAD, overlong_filtering=False)
    assert batch["token_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1]
    routed = batch["routed_experts"]
    assert routed.shape == (2, 9, 2, 2)
    assert torch.equal(routed[0], torch.cat([first[0, :5], second[0, 5:9]]))
    assert bool((routed[0, 8] == -1).all())  # the last response's last token: no forward ran it
    assert bool((routed[1] == -1).all())  # a row no call covered, and padding
    assert ROUTED_EXPERTS_KEY not in RolloutTokens.from_prompts([short], PAD).batch_fields()
    packed = PackedRows.pack(batch["input_ids"], batch["input_lengths"], 4)
    rows = replay_rows(batch, packed)
    assert rows is not None and rows.shape == (12, 2, 2)
    assert torch.equal(rows[:9], routed[0]) and bool((rows[9:] == -1).all())
    plain = replay_rows(batch, None)
    assert plain is not None and torch.equal(plain.view(2, 9, 2, 2), routed)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"model_name": str(ASSETS / "tiny_qwen2_init")}, "is a qwen2 model"),
        ({"generation": {"backend": "vllm"}}, "CPUModelRunner"),
        ({"dtensor_cfg": {"activation_checkpointing": True}}, "activation_checkpointing=false"),
    ],
)
def test_config_refuses_router_replay_where_it_cannot_work(overrides: dict, fragment: str) -> None:
    cfg = {"model_name": str(ASSETS / "tiny_qwen3_moe_init"), "router_replay": {"enabled": True}}
    with pytest.raises(ValueError, match=fragment):
        PolicyConfig.model_validate({**cfg, **overrides})
    with pytest.raises(ValueError, match="SFT does not build"):
        SFTMasterConfig.model_validate({"policy": cfg})
