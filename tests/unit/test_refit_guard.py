"""The refit guard: order-free checksums that survive an engine's fusing, sharding and padding; the comparison
that names the tensor (or the fused group) an engine holds differently; the Refitter's stop, refit and warn;
the ``gen_kl_error`` probe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.weight_sync import refitter as refitter_module
from nemo_rl.weight_sync.checksums import add, combine_ranks, named_checksums, tensor_checksum, total
from nemo_rl.weight_sync.guard import RefitDivergenceError, find_divergence
from nemo_rl.weight_sync.interfaces import TransferStats
from nemo_rl.weight_sync.refitter import Refitter

G = torch.Generator().manual_seed(0)
HF = {
    "model.embed_tokens.weight": torch.randn(10, 4, generator=G),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=G),
    "model.layers.0.self_attn.k_proj.weight": torch.randn(2, 4, generator=G),
    "model.layers.0.self_attn.v_proj.weight": torch.randn(2, 4, generator=G),
    "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4, generator=G),
    "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=G),
    "model.layers.0.input_layernorm.weight": torch.ones(4),
}
EXPECTED = named_checksums(HF.items())


def vllm_style(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as vLLM holds them: q, k and v fused, the vocabulary padded with zero rows."""
    attn = "model.layers.0.self_attn"
    held = {n: t for n, t in weights.items() if not n.startswith(f"{attn}.") or "o_proj" in n}
    held[f"{attn}.qkv_proj.weight"] = torch.cat([weights[f"{attn}.{p}_proj.weight"] for p in "qkv"])
    held["model.embed_tokens.weight"] = torch.cat([weights["model.embed_tokens.weight"], torch.zeros(6, 4)])
    return held


def test_checksums_add_over_fusion_shards_and_zero_padding() -> None:
    a, b = torch.randn(3, 4, generator=G), torch.randn(5, 4, generator=G)
    assert tensor_checksum(torch.cat([a, b])) == add(tensor_checksum(a), tensor_checksum(b))
    assert tensor_checksum(torch.cat([a, torch.zeros(7, 4)])) == tensor_checksum(a)
    assert total(tensor_checksum(shard) for shard in a.chunk(2, dim=1)) == tensor_checksum(a)
    # One element off, or the same values in another dtype, is another checksum.
    changed = a.clone()
    changed[1, 2] = torch.nextafter(changed[1, 2], torch.tensor(1e9))
    assert tensor_checksum(changed) != tensor_checksum(a)
    assert tensor_checksum(a.double()) != tensor_checksum(a)
    # Held in float32, sent in bfloat16: compared as sent.
    sent = a.to(torch.bfloat16)
    assert tensor_checksum(sent.float(), torch.bfloat16) == tensor_checksum(sent)


def test_divergence_names_the_tensor_or_the_fused_group() -> None:
    assert find_divergence(EXPECTED, named_checksums(HF.items())) == []
    assert find_divergence(EXPECTED, named_checksums(vllm_style(HF).items())) == []

    corrupted = dict(HF)
    corrupted["model.layers.0.mlp.down_proj.weight"] = HF["model.layers.0.mlp.down_proj.weight"] * 2
    assert find_divergence(EXPECTED, named_checksums(corrupted.items())) == [
        "model.layers.0.mlp.down_proj.weight"
    ]
    assert find_divergence(EXPECTED, named_checksums(vllm_style(corrupted).items())) == [
        "model.layers.0.mlp.down_proj.weight"
    ]
    corrupted = dict(HF)
    corrupted["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(2, 4)
    assert find_divergence(EXPECTED, named_checksums(vllm_style(corrupted).items())) == [
        "model.layers.0.self_attn.{k_proj, q_proj, v_proj} (held as model.layers.0.self_attn.qkv_proj)"
    ]
    # A weight the engine does not hold, and one it holds that was never sent.
    missing = {n: c for n, c in EXPECTED.items() if "o_proj" not in n}
    assert find_divergence(EXPECTED, missing) == ["model.layers.0.self_attn.o_proj (not held)"]
    extra = {**EXPECTED, "lm_head.weight": tensor_checksum(HF["model.embed_tokens.weight"])}
    assert find_divergence(EXPECTED, extra) == ["lm_head (held, never sent)"]


def test_tensor_parallel_ranks_add_their_shards_and_count_replicas_once() -> None:
    weights = {"w": torch.randn(4, 6, generator=G), "norm": torch.randn(6, generator=G)}
    ranks = [named_checksums([("w", shard), ("norm", weights["norm"])]) for shard in weights["w"].chunk(2)]
    assert combine_ranks(ranks) == named_checksums(weights.items())


class _Actor:
    def __init__(self, name: str) -> None:
        self._actor_id = bytes(name, "ascii")


class Policy:
    def __init__(self) -> None:
        self.workers: Sequence[Any] = [_Actor("p0")]
        self.worker_node_ids = ["n0"]

    def refit_streams(self) -> list[int]:
        return [0]

    def adapter_refits(self) -> bool:
        return False

    def weights_manifest(self, dtype: torch.dtype, scope: str = "full") -> dict[str, Any]:
        return {name: (tuple(t.shape), "float32") for name, t in HF.items()}

    def offload_before_refit(self) -> None:
        pass

    def offload_after_refit(self) -> None:
        pass


class Engines:
    """Two engine replicas holding vLLM-style weights; ``corrupt`` changes what replica 1 holds."""

    hosted_in_policy = False

    def __init__(self) -> None:
        self.workers: Sequence[Any] = [_Actor("g0"), _Actor("g1")]
        self.worker_node_ids = ["n0", "n0"]
        self.corrupt: str | None = None
        self.loads = 0

    def expected_weights_manifest(self, scope: str = "full") -> dict[str, Any]:
        return {name: (tuple(t.shape), "float32") for name, t in HF.items()}

    def held_weight_checksums(self) -> list[Any]:
        held = dict(HF)
        if self.corrupt is not None:
            held[self.corrupt] = held[self.corrupt] + 1
        return [[named_checksums(HF.items())], [named_checksums(vllm_style(held).items())]]

    def set_refill(self, refill: Any) -> None:
        self.refill = refill

    def replace_lost_workers(self) -> bool:
        return False  # these engines never die


def refitter_for(engines: Engines, monkeypatch: pytest.MonkeyPatch, **guard: Any) -> Refitter:
    def fake_refit(*args: Any, **kwargs: Any) -> tuple[dict[str, float], list[TransferStats]]:
        engines.loads += 1
        received = TransferStats("receiver", 0, 0, len(HF), 0.0, checksums=dict(EXPECTED))
        return {"refit/bytes": 1.0}, [received, TransferStats("receiver", 0, 0, len(HF), 0.0)]

    monkeypatch.setattr(refitter_module, "create_refit_transport", lambda *a, **k: object())
    monkeypatch.setattr(refitter_module, "refit_with_stats", fake_refit)
    cfg = PolicyConfig.model_validate({"model_name": "unused", "refit": {"guard": guard}})
    return Refitter.create(cfg, Policy(), engines)  # type: ignore[arg-type]


def test_a_corrupted_engine_stops_the_run_naming_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    engines = Engines()
    refitter = refitter_for(engines, monkeypatch)
    assert refitter.refit()["refit/guard_s"] >= 0  # a clean refit passes
    engines.corrupt = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(RefitDivergenceError) as err:
        refitter.verify()
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    assert (
        "generation engine 1 holds model.layers.0.mlp.down_proj.weight unlike what the policy sent" in message
    )
    assert "engine 0" not in message
    assert refitter.stale  # the next refit is due, and full


def test_on_mismatch_refit_sends_again_and_warn_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = Engines()
    refitter = refitter_for(engines, monkeypatch, on_mismatch="refit")
    engines.corrupt = "model.embed_tokens.weight"
    with pytest.raises(RefitDivergenceError, match="after sending every weight again"):
        refitter.refit()
    assert engines.loads == 2
    assert "sending every weight again" in capsys.readouterr().out

    engines = Engines()
    refitter = refitter_for(engines, monkeypatch, on_mismatch="warn")
    engines.corrupt = "model.embed_tokens.weight"
    assert "refit/guard_s" in refitter.refit()
    assert (
        "WARNING: refit guard: generation engine 1 holds model.embed_tokens.weight" in capsys.readouterr().out
    )
    assert not refitter.stale


def test_the_probe_stops_past_max_gen_kl_error_and_says_whether_a_tensor_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = Engines()
    refitter = refitter_for(engines, monkeypatch, max_gen_kl_error=1e-3)
    refitter.refit()
    refitter.probe(1e-4)
    with pytest.raises(RefitDivergenceError, match=r"0\.5 exceeds .*max_gen_kl_error=0\.001: every tensor"):
        refitter.probe(0.5)
    refitter.refit()
    engines.corrupt = "model.layers.0.self_attn.v_proj.weight"
    with pytest.raises(
        RefitDivergenceError, match=r"nan exceeds .*engine 1 holds .*\{k_proj, q_proj, v_proj\}"
    ):
        refitter.probe(float("nan"))


def test_a_script_stopped_by_the_guard_exits_2_with_its_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nemo_rl.config.cli import run_cli

    engines = Engines()
    refitter = refitter_for(engines, monkeypatch)
    refitter.refit()
    engines.corrupt = "model.layers.0.input_layernorm.weight"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(refitter.refit)  # as the scripts run their loop: the next refit finds the engine changed
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err.strip()
    assert len(stderr.splitlines()) == 1
    assert "error: refit guard: generation engine 1 holds model.layers.0.input_layernorm.weight" in stderr


def test_a_copy_inside_one_process_is_checked_too() -> None:
    """An engine hosted in the policy's worker: the copy's stream against what the engine then holds."""
    from nemo_rl.config.refit import RefitGuardConfig
    from nemo_rl.weight_sync.guard import check_in_process, recording

    cfg = RefitGuardConfig()
    sent: dict[str, Any] = {}
    assert [name for name, _ in recording(HF.items(), sent, torch.float32)] == list(HF)
    check_in_process(cfg, sent, named_checksums(HF.items()), "full")
    corrupted = {**HF, "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8)}
    with pytest.raises(
        RefitDivergenceError, match=r"this policy worker holds model\.layers\.0\.mlp\.down_proj\.weight"
    ):
        check_in_process(cfg, sent, named_checksums(corrupted.items()), "full")
    # An adapters-only copy is compared on the adapters; the engine's other weights are not part of it.
    adapters = {"model.layers.0.mlp.down_proj.lora_A": torch.ones(2, 8)}
    sent = dict(named_checksums(adapters.items()))
    check_in_process(cfg, sent, named_checksums({**HF, **adapters}.items()), "adapters")
