"""The vLLM generation backend.

Everything but the last test runs without vLLM or a GPU: engine arguments from the config, per-request
sampling parameters (against a stand-in ``SamplingParams`` class), vLLM completions -> the generation
contract's output batch, the refit manifest, the worker extension's weight loading, and the worker's
request routing / sleep-wake bookkeeping around a stand-in engine. The ``vllm`` test runs the real engine
on a GPU and checks greedy parity with Hugging Face, before and after a weight update.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

import nemo_rl.models.generation.vllm.worker as worker_module
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.tiny import build_tiny_tokenizer
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.vllm.convert import (
    LOAD_WEIGHTS_RPC,
    WORKER_EXTENSION_CLS,
    assemble_outputs,
    check_named_tensors,
    check_vllm_config,
    engine_kwargs,
    generation_budgets,
    hf_weights_manifest,
    max_sequence_length,
    prompt_token_ids,
    request_seeds,
    sampling_params_for_rows,
)
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
from nemo_rl.models.generation.vllm.worker_extension import VllmWorkerExtension
from nemo_rl.weight_sync.interfaces import LoadFn, TransferStats

VOCAB = 104  # the tiny character-level tokenizer's size


def policy_cfg(**overrides: Any) -> PolicyConfig:
    """A vLLM-backed policy section; ``generation`` / ``vllm_cfg`` entries merge into the defaults below."""
    generation = {"backend": "vllm", "max_new_tokens": 4, **overrides.pop("generation", {})}
    generation["vllm_cfg"] = {"gpu_memory_utilization": 0.5, **overrides.pop("vllm_cfg", {})}
    return PolicyConfig.model_validate(
        {"model_name": "org/model", "max_total_sequence_length": 16, "generation": generation, **overrides}
    )


# ------------------------------------------------------------------------------------ engine arguments
def test_engine_kwargs_follow_the_config() -> None:
    cfg = policy_cfg(vllm_cfg={"precision": "float16", "enforce_eager": True}, trust_remote_code=True)
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
        "seed": 7,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
        "logprobs_mode": "processed_logprobs",
        "enable_sleep_mode": True,  # colocated by default
    }
    # The extension path must resolve to the class (vLLM imports it by name in its worker).
    module_name, class_name = WORKER_EXTENSION_CLS.rsplit(".", 1)
    assert getattr(importlib.import_module(module_name), class_name) is VllmWorkerExtension


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


@pytest.mark.parametrize(
    ("vllm_cfg", "message"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"async_engine": True}, "async_engine"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_unsupported_vllm_settings_fail_clearly(vllm_cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        check_vllm_config(policy_cfg(vllm_cfg=vllm_cfg))


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
        -1,
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
    assert (sampled.temperature, sampled.top_k, sampled.seed) == (1.0, -1, 5)  # top_k None -> -1 (off)


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


def test_check_named_tensors_names_every_problem() -> None:
    manifest = {"a": ((2, 3), "float32"), "b": ((4,), "float32"), "c": ((1,), "float32")}
    good = [("a", torch.zeros(2, 3, dtype=torch.float16)), ("b", torch.zeros(4)), ("c", torch.zeros(1))]
    assert check_named_tensors(manifest, good) == []  # dtypes are cast when loading
    problems = check_named_tensors(
        manifest,
        [("a", torch.zeros(3, 2)), ("b", torch.zeros(4)), ("b", torch.zeros(4)), ("z", torch.zeros(1))],
    )
    text = "\n".join(problems)
    assert "more than once: ['b']" in text
    assert "missing: ['c']" in text
    assert "not part of the generation model: ['z']" in text
    assert "a: shape (3, 2) given, (2, 3) expected" in text


# ------------------------------------------------------------------------------------ worker extension
class RecordingModel(nn.Module):
    """A model whose ``load_weights`` behaves like vLLM's: consumes the stream, may hold tensors a while."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        held = list(weights)  # like a fused loader waiting for all of q/k/v before writing
        self.loaded.update(held)
        return {name for name, _ in held}


class FakeVllmWorker(VllmWorkerExtension):
    """vLLM's GPU worker with the extension mixed in: it provides ``model_runner.model``."""

    def __init__(self, model: nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)


def reused_buffer_stream(values: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields views into ONE buffer that is overwritten for the next pair, like a refit transfer buffer."""
    buffer = torch.empty(3)
    for index, value in enumerate(values):
        buffer.fill_(value)
        yield f"w{index}", buffer.view(3)


def test_worker_extension_loads_copies_through_load_weights() -> None:
    model = RecordingModel()
    num_bytes = FakeVllmWorker(model).nemo_rl_load_hf_weights(reused_buffer_stream([1.0, 2.0, 3.0]))
    assert num_bytes == 3 * 3 * 4
    assert {name: t.tolist() for name, t in model.loaded.items()} == {
        "w0": [1.0] * 3,
        "w1": [2.0] * 3,
        "w2": [3.0] * 3,
    }
    assert all(t.device == model.anchor.device for t in model.loaded.values())
    assert hasattr(FakeVllmWorker, LOAD_WEIGHTS_RPC)


def test_worker_extension_adds_only_prefixed_attributes() -> None:
    # vLLM refuses an extension whose attributes clash with its worker's (e.g. `model_runner`, `load_model`).
    own = [name for name in vars(VllmWorkerExtension) if not name.startswith("__")]
    assert own == [LOAD_WEIGHTS_RPC]


# ------------------------------------------------------------------------------------ worker logic
class FakeLLM:
    """Stands in for ``vllm.LLM``: records calls; generates ``prompt[-1] + 1, + 2, ...`` (at most 3 tokens)."""

    def __init__(self, vllm_worker: FakeVllmWorker) -> None:
        self.vllm_worker = vllm_worker
        self.calls: list[tuple[Any, ...]] = []

    def generate(self, prompts: list[dict[str, list[int]]], params: list[Any], use_tqdm: bool) -> list[Any]:
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], params))
        outputs = []
        for prompt, row_params in zip(prompts, params, strict=True):
            num = min(row_params.max_tokens, 3)
            tokens = [(prompt["prompt_token_ids"][-1] + k + 1) % VOCAB for k in range(num)]
            reason = "length" if num == row_params.max_tokens else "stop"
            values = [-0.5 * (k + 1) for k in range(num)]
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

    def _start_engine(self, seed: int) -> Any:
        self._sampling_params_cls = FakeSamplingParams
        self.model = RecordingModel()
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
    return FakeEngineWorker(cfg, tokenizer, seed=3)


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
        ("collective_rpc", LOAD_WEIGHTS_RPC),
        ("reset_prefix_cache",),  # cached prefixes were computed with the old weights
        ("wake_up", ["kv_cache"]),
    ]
    assert set(worker.model.loaded) == set(manifest)
    assert num_bytes == sum(t.numel() * 4 for _, t in weights)

    with pytest.raises(ValueError, match="missing"):
        worker.load_weights_from_stream(weights[1:])

    apart = fake_worker(
        model_dir,
        tokenizer,
        monkeypatch,
        generation={"colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}},
    )
    apart.finish_generation()
    apart.prepare_for_generation()
    assert apart.llm.calls == []


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


# ------------------------------------------------------------------------------------ real engine (GPU)
def _vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (uv sync --extra vllm)"
    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU"
    return None


# Decided at collection, so that a machine without vLLM or a GPU does not start Ray for a skipped test.
_VLLM_SKIP_REASON = _vllm_skip_reason()


def _check_greedy_parity(hf: Qwen2ForCausalLM, out: BatchedDataDict[Any], lengths: torch.Tensor) -> None:
    """Every generated token is HF's argmax given the sequence so far, with HF's log-prob."""
    for row in range(out.size):
        start = int(lengths[row])
        end = int(out["unpadded_sequence_lengths"][row])
        assert end > start
        ids = out["output_ids"][row, :end]
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
        for position in range(start, end):
            step = logprobs_TV[position - 1]
            token = int(ids[position])
            # Argmax up to float noise (a near-tie may go either way in different kernels).
            assert step[token] >= step.max() - 1e-2, (row, position, token, int(step.argmax()))
            assert abs(float(out["logprobs"][row, position]) - float(step[token])) < 1e-2


@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_SKIP_REASON is not None, reason=_VLLM_SKIP_REASON or "")
def test_vllm_greedy_matches_hf_before_and_after_weight_update(
    ray_cluster: dict[str, float], tmp_path: Path
) -> None:
    from nemo_rl.config.cluster import ClusterConfig
    from nemo_rl.data.tiny import build_tiny_model
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation.vllm.generation import VllmGeneration
    from nemo_rl.models.tokenizer import get_tokenizer

    tokenizer_dir, model_dir = tmp_path / "tokenizer", tmp_path / "model"
    build_tiny_tokenizer(tokenizer_dir)
    hf = build_tiny_model(model_dir, tokenizer_dir, seed=0).eval()
    with torch.no_grad():  # larger weights than the default init: clear argmax margins
        generator = torch.Generator().manual_seed(1)
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.25)
    hf.save_pretrained(model_dir)
    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": 48,
            "generation": {
                "backend": "vllm",
                "max_new_tokens": 10,
                "vllm_cfg": {"precision": "float32", "gpu_memory_utilization": 0.3, "enforce_eager": True},
            },
        }
    )
    tokenizer = get_tokenizer(cfg.tokenizer, model_name=str(model_dir), trust_remote_code=False)
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=1), name="vllm_test")
    generation = None
    try:
        generation = VllmGeneration(cluster, cfg, tokenizer, seed=0)
        pad = int(tokenizer.pad_token_id)
        prompts = [[5, 17, 30, 42, 8], [60, 3, 22]]
        input_ids = torch.full((2, 5), pad)
        for row, prompt in enumerate(prompts):
            input_ids[row, : len(prompt)] = torch.tensor(prompt)
        lengths = torch.tensor([len(p) for p in prompts])
        data = BatchedDataDict(input_ids=input_ids, input_lengths=lengths)

        out = generation.generate(data, greedy=True)
        assert out["output_ids"][:, :5].tolist() == [[5, 17, 30, 42, 8], [60, 3, 22, pad, pad]]
        _check_greedy_parity(hf, out, lengths)

        # Colocated round trip, then new weights (loaded while asleep, through the worker extension).
        generation.finish_generation()
        with torch.no_grad():
            for param in hf.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.25)
        assert generation.expected_weights_manifest() == {
            name: (tuple(p.shape), "float32") for name, p in hf.named_parameters()
        }
        generation.update_weights(hf.named_parameters())
        generation.prepare_for_generation()
        updated = generation.generate(data, greedy=True)
        _check_greedy_parity(hf, updated, lengths)
        assert not torch.equal(updated["output_ids"], out["output_ids"])
    finally:
        if generation is not None:
            generation.shutdown()
        cluster.shutdown()
