"""Refit from the real DTensor policy (FSDP2 dp=2, or TP=2) into the embedded generation engine.

The engines hosted in the policy workers (``in_policy_workers``) refit in process to the policy's full
weights and sample exactly what a separate generation worker samples with the same weights and seeds.

For both transports: every generation weight equals the policy's full weight bit for bit; a training step
changes the policy, the refit carries the change, and greedy generation afterwards equals greedy generation
from the exported policy checkpoint. The engine's sampled-token log-probs match the policy's: under the full
distribution (FSDP) and under top-k + top-p sampling at a temperature (TP=2), where the policy must score the
same filtered, renormalised distribution the engine drew from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig, RefitConfig
from nemo_rl.data.llm_message_utils import message_logs_to_batch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.embedded.generation import EmbeddedGeneration
from nemo_rl.models.generation.embedded.in_policy import InPolicyEmbeddedGeneration
from nemo_rl.models.generation.factory import create_generation
from nemo_rl.models.generation.interfaces import GENERATION_OUTPUT_KEYS
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.weight_sync.errors import RefitError
from nemo_rl.weight_sync.factory import create_refit_transport
from nemo_rl.weight_sync.guard import RefitDivergenceError
from nemo_rl.weight_sync.refit import refit
from nemo_rl.weight_sync.refitter import Refitter

TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_math_sft"
TIMEOUT_S = 300.0
PROMPTS = ["What is 12+7?", "What is 40-3?", "What is 8+33?", "What is 25-30?"]


# The TP=2 stack samples with top-k and top-p at a temperature (see the module docstring).
FILTERED_SAMPLING = {"temperature": 0.8, "top_k": 5, "top_p": 0.9}


def _policy_cfg(tp_size: int, model_name: str = str(TINY_MODEL), lora: bool = False) -> PolicyConfig:
    sampling = FILTERED_SAMPLING if tp_size == 2 else {}
    # LoRA on q/v and down only: the adapted layers' base copies and merges, next to layers refitted whole.
    lora_cfg = {
        "enabled": lora,
        "match_all_linear": False,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    }
    return PolicyConfig.model_validate(
        {
            "model_name": model_name,
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
            "max_total_sequence_length": 48,
            "precision": "float32",
            "dtensor_cfg": {"tensor_parallel_size": tp_size, "lora_cfg": lora_cfg},
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
            # The key lets the policy's workers host engines too (InPolicyEmbeddedGeneration); the separate
            # generation workers ignore it.
            "generation": {
                "max_new_tokens": 16,
                "embedded_cfg": {"precision": "float32", "in_policy_workers": True},
                **sampling,
            },
        }
    )


def _prompt_batch(tokenizer: Any) -> BatchedDataDict[Any]:
    logs: list[Any] = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        logs.append([{"role": "user", "content": text, "token_ids": torch.tensor(tokenizer.encode(text))}])
    return message_logs_to_batch(logs, pad_token_id=tokenizer.pad_token_id, train_roles=())


def _sft_batch(tokenizer: Any) -> BatchedDataDict[Any]:
    logs: list[Any] = []
    for prompt, answer in zip(PROMPTS, ["1", "2", "3", "4"], strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"\\boxed{{{answer}}}"}],
            tokenize=False,
        )
        logs.append(
            [{"role": "assistant", "content": text, "token_ids": torch.tensor(tokenizer.encode(text))}]
        )
    batch = message_logs_to_batch(logs, pad_token_id=tokenizer.pad_token_id, train_roles=("assistant",))
    batch["sample_mask"] = torch.ones(len(logs))
    return batch


def _generation_weights(generation: EmbeddedGeneration) -> dict[str, torch.Tensor]:
    import ray

    return cast(
        dict[str, torch.Tensor], ray.get(generation.workers[0].named_weights.remote(), timeout=TIMEOUT_S)
    )


def _policy_weights(policy: Policy, path: Path) -> dict[str, torch.Tensor]:
    policy.export_hf(str(path))
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def _assert_bit_equal(
    generation_weights: dict[str, torch.Tensor], policy_weights: dict[str, torch.Tensor]
) -> None:
    assert set(generation_weights) == set(policy_weights)
    for name, tensor in generation_weights.items():
        expected = policy_weights[name]
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor, expected), f"{name} differs after refit"


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp_dp2", "tp2"])
def stack(request: pytest.FixtureRequest, ray_cluster: Any) -> Iterator[tuple[Any, ...]]:
    tp_size = request.param
    cfg = _policy_cfg(tp_size)
    tokenizer = get_policy_tokenizer(cfg)
    cluster = RayVirtualCluster(
        ClusterConfig(gpus_per_node=2, placement_timeout_s=120), name=f"refit_tp{tp_size}"
    )
    policy = Policy(cluster, cfg, name_prefix=f"refit_policy_tp{tp_size}", init_reference_model=False)
    generation = create_generation(cluster, cfg, tokenizer, seed=0, bundle_indices=[0])
    assert isinstance(generation, EmbeddedGeneration)
    try:
        yield policy, generation, tokenizer, cluster
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("transport_kind", ["shared_memory", "collective"])
def test_refit_carries_a_training_step(
    stack: tuple[Policy, EmbeddedGeneration, Any, RayVirtualCluster], transport_kind: str, tmp_path: Path
) -> None:
    policy, generation, tokenizer, cluster = stack
    cfg = _policy_cfg(policy.cfg.dtensor_cfg.tensor_parallel_size)
    locations = cluster.bundle_locations()
    transport = create_refit_transport(
        cfg,
        RefitConfig.model_validate({"transport": transport_kind, "timeout_s": TIMEOUT_S}),
        policy_node_ids=[locations[b].node_id for b in range(2)],
        generation_node_ids=generation.worker_node_ids,
    )
    try:
        before = _generation_weights(generation)
        policy.train(_sft_batch(tokenizer), NLLLoss())
        metrics = refit(policy.workers, generation.workers, transport, timeout_s=TIMEOUT_S)
        after = _generation_weights(generation)
    finally:
        transport.shutdown()

    assert metrics["refit/bytes"] == sum(t.numel() * t.element_size() for t in after.values())
    assert metrics["refit/time_s"] > 0 and metrics["refit/gbps"] > 0
    assert any(not torch.equal(before[n], after[n]) for n in after), "the training step changed nothing"
    export = tmp_path / "export"
    _assert_bit_equal(after, _policy_weights(policy, export))

    prompts = _prompt_batch(tokenizer)
    if transport_kind == "shared_memory":
        # The engine samples with the weights it holds: greedy generation after the refit equals greedy
        # generation from the exported checkpoint. (Once per layout: the engine is the same for both
        # transports, and the bit-equality above is what each transport must deliver.)
        refitted = generation.generate(prompts, greedy=True)
        from_export = create_generation(
            cluster, _policy_cfg(1, str(export)), tokenizer, seed=0, bundle_indices=[1]
        )
        try:
            exported = from_export.generate(prompts, greedy=True)
        finally:
            from_export.shutdown()
        assert torch.equal(refitted["output_ids"], exported["output_ids"])

    # The engine's log-probs of what it sampled match the policy's for the same weights and tokens.
    sampled = generation.generate(prompts, greedy=False)
    scored = BatchedDataDict[Any](
        input_ids=sampled["output_ids"], input_lengths=sampled["unpadded_sequence_lengths"]
    )
    policy_logprobs = policy.get_logprobs(scored)["logprobs"]
    for row in range(len(PROMPTS)):
        start = int(prompts["input_lengths"][row])
        end = int(sampled["unpadded_sequence_lengths"][row])
        diff = (sampled["logprobs"][row, start:end] - policy_logprobs[row, start:end]).abs().max()
        assert diff <= 1e-4, f"row {row}: engine and policy log-probs differ by {diff}"


def test_in_policy_engine_refits_in_process_and_samples_as_separate_workers(
    stack: tuple[Policy, EmbeddedGeneration, Any, RayVirtualCluster], tmp_path: Path
) -> None:
    import ray

    policy, generation, tokenizer, _ = stack
    in_policy = InPolicyEmbeddedGeneration(policy, tokenizer, seed=0)
    policy.train(_sft_batch(tokenizer), NLLLoss())
    # As RL runs refit it: the Refitter checks both manifests, builds no transport and copies in process.
    refitter = Refitter.create(policy.cfg, policy, in_policy)
    assert refitter.transport is None
    metrics = refitter.refit()
    policy_weights = _policy_weights(policy, tmp_path / "export")
    # Every replica (the first tensor-parallel rank of each data-parallel group) holds the full weights.
    group = policy.worker_group
    for rank in group.dp_leader_ranks:
        ref = group.run_single_worker("embedded_generation_weights", rank)
        _assert_bit_equal(ray.get(ref, timeout=TIMEOUT_S), policy_weights)
    assert metrics["refit/bytes"] == sum(t.numel() * t.element_size() for t in policy_weights.values())
    assert metrics["refit/bytes_received"] == metrics["refit/bytes"] * policy.dp_size

    # Bit-identical sampling: the separate worker (data-parallel rank 0) given the same weights, shard and
    # call seed samples what the hosted replica of rank 0 sampled.
    generation.update_weights(policy_weights.items())
    prompts = _prompt_batch(tokenizer)
    in_policy.finish_generation()
    in_policy.prepare_for_generation()
    call_seed = 0 * 1_000_003 + in_policy.num_generate_calls
    sampled = in_policy.generate(prompts)
    rows = prompts.shard_indices(
        policy.dp_size, allow_uneven_shards=True, balance_by_length_key="input_lengths"
    )[0]
    expected = ray.get(
        generation.workers[0].generate.remote(prompts.select_indices(rows), False, call_seed),
        timeout=TIMEOUT_S,
    )
    for key in GENERATION_OUTPUT_KEYS:
        got = sampled[key][rows]
        if got.dim() == 2:
            width = expected[key].shape[1]
            assert not got[:, width:].any() or key == "output_ids", key
            got = got[:, :width]
        assert torch.equal(got, expected[key]), f"{key} differs from the separate worker's"


# ------------------------------------------------------------------------------------------------ LoRA
def test_the_refit_guard_names_a_tensor_the_engine_holds_differently(
    stack: tuple[Policy, EmbeddedGeneration, Any, RayVirtualCluster],
) -> None:
    """A refit the engine loads as sent passes the guard; one weight changed in the engine afterwards (as a
    faulty loader or memory would) stops the run with one line naming it; the next refit repairs it."""
    policy, generation, _, _ = stack
    refitter = Refitter.create(_policy_cfg(policy.cfg.dtensor_cfg.tensor_parallel_size), policy, generation)
    name = "model.layers.1.mlp.down_proj.weight"
    try:
        assert refitter.refit()["refit/guard_s"] > 0
        weights = _generation_weights(generation)
        weights[name][3, 5] += 0.5
        generation.update_weights(weights.items())
        with pytest.raises(RefitDivergenceError) as err:
            refitter.verify()
        message = str(err.value)
        assert f"refit guard: generation engine 0 holds {name} unlike what the policy sent" in message
        assert "\n" not in message and message.count("model.") == 1
        assert refitter.stale
        refitter.refit()
        assert "refit/guard_s" in refitter.verify()
        assert not torch.equal(_generation_weights(generation)[name], weights[name])
    finally:
        refitter.shutdown()


@pytest.fixture(scope="module")
def lora_stack(ray_cluster: Any) -> Iterator[tuple[Any, ...]]:
    """A LoRA policy (FSDP dp=2, engines hosted in its workers too) and one separate generation worker."""
    cfg = _policy_cfg(1, lora=True)
    tokenizer = get_policy_tokenizer(cfg)
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=2, placement_timeout_s=120), name="refit_lora")
    policy = Policy(cluster, cfg, name_prefix="refit_lora_policy", init_reference_model=False)
    generation = create_generation(cluster, cfg, tokenizer, seed=0, bundle_indices=[0])
    try:
        yield policy, generation, tokenizer, cluster
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def _adapter_bytes(policy: Policy) -> int:
    manifest = policy.weights_manifest(torch.float32, "adapters")
    assert manifest and all(".lora_" in name for name in manifest)
    return int(sum(4 * math.prod(shape) for shape, _ in manifest.values()))


def _assert_engine_scores_as_policy(policy: Policy, generation: Any, tokenizer: Any) -> None:
    """The engine's greedy tokens and their log-probs are the LoRA policy's (fp32, tight tolerance)."""
    prompts = _prompt_batch(tokenizer)
    greedy = generation.generate(prompts, greedy=True)
    scored = BatchedDataDict[Any](
        input_ids=greedy["output_ids"], input_lengths=greedy["unpadded_sequence_lengths"]
    )
    policy_logprobs = policy.get_logprobs(scored)["logprobs"]
    for row in range(len(PROMPTS)):
        start, end = int(prompts["input_lengths"][row]), int(greedy["unpadded_sequence_lengths"][row])
        diff = (greedy["logprobs"][row, start:end] - policy_logprobs[row, start:end]).abs().max()
        assert diff <= 1e-4, f"row {row}: engine and LoRA policy log-probs differ by {diff}"


@pytest.mark.parametrize("transport_kind", ["shared_memory", "collective"])
def test_lora_refits_send_the_adapters_only_after_the_first(
    lora_stack: tuple[Policy, EmbeddedGeneration, Any, RayVirtualCluster], transport_kind: str
) -> None:
    """Driven as RL loops drive it (the run's ``Refitter``): the first refit moves the base weights and the
    adapters, later ones the adapters only; a replaced generation worker gets a full refit again (checked with
    the collective transport)."""
    policy, generation, tokenizer, cluster = lora_stack
    refit_cfg = RefitConfig.model_validate({"transport": transport_kind, "timeout_s": TIMEOUT_S})
    cfg = _policy_cfg(1, lora=True).model_copy(update={"refit": refit_cfg})
    locations = cluster.bundle_locations()

    def make_transport(generation: EmbeddedGeneration) -> Any:
        return create_refit_transport(
            cfg,
            refit_cfg,
            policy_node_ids=[locations[b].node_id for b in range(2)],
            generation_node_ids=generation.worker_node_ids,
        )

    refitter = Refitter.create(cfg, policy, generation)
    assert refitter.transport is not None and refitter.transport.kind == transport_kind
    full_bytes = sum(4 * math.prod(shape) for shape, _ in policy.weights_manifest(torch.float32).values())
    fresh = None
    try:
        first = refitter.refit()
        assert first["refit/adapters_only"] == 0.0 and first["refit/bytes"] == full_bytes
        policy.train(_sft_batch(tokenizer), NLLLoss())
        refitter.mark_stale()
        second = refitter.refit_if_stale()
        # The refit guard found the engine holding the base weights and adapters it was sent (merged).
        assert second["refit/adapters_only"] == 1.0 and second["refit/guard_s"] > 0
        assert second["refit/bytes"] == _adapter_bytes(policy) < full_bytes / 10
        _assert_engine_scores_as_policy(policy, generation, tokenizer)
        if transport_kind != "collective":
            return
        # A fresh engine (a restarted or replaced worker, with a transport of its own: the collective one's
        # process group names its members, so it is the transport checked) refuses adapters alone, and the
        # driver never sends them: the refit after the replacement is full.
        fresh = create_generation(cluster, cfg, tokenizer, seed=0, bundle_indices=[1])
        refitter.shutdown()
        refitter.target, refitter.transport = fresh, make_transport(fresh)
        assert refitter.transport is not None
        with pytest.raises(RefitError, match="holds no base weights"):
            refit(policy.workers, fresh.workers, refitter.transport, timeout_s=TIMEOUT_S, scope="adapters")
        replaced = refitter.refit()
        assert replaced["refit/adapters_only"] == 0.0 and replaced["refit/bytes"] == full_bytes
        _assert_engine_scores_as_policy(policy, fresh, tokenizer)
    finally:
        refitter.shutdown()
        if fresh is not None:
            fresh.shutdown()


def test_lora_in_policy_engine_refits_adapters_in_process(
    lora_stack: tuple[Policy, EmbeddedGeneration, Any, RayVirtualCluster],
) -> None:
    policy, _, tokenizer, _ = lora_stack
    in_policy = InPolicyEmbeddedGeneration(policy, tokenizer, seed=0)
    full = in_policy.refit_in_process("full")
    assert full["refit/bytes"] == sum(
        4 * math.prod(shape) for shape, _ in in_policy.expected_weights_manifest("full").values()
    )
    policy.train(_sft_batch(tokenizer), NLLLoss())
    adapters = in_policy.refit_in_process("adapters")
    assert adapters["refit/bytes"] == _adapter_bytes(policy)
    assert adapters["refit/bytes_received"] == adapters["refit/bytes"] * policy.dp_size
    _assert_engine_scores_as_policy(policy, in_policy, tokenizer)
