"""Evaluation benchmarks: each built-in one read in its hub schema (local file or hub name), any other file
with named columns, the tiny held-out split, prompts, the config checks of the eval sections, and the
backend the eval config selects."""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_rl.config.data import DataConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.eval import EvalDataConfig
from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import EvalMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.datasets import MalformedRowError, eval_datasets, load_dataset_splits
from nemo_rl.data.datasets.eval_datasets import gsm8k_final_answer, load_eval_records, setup_eval_data
from nemo_rl.evals.eval import generation_policy_config, resolve_model
from nemo_rl.models.generation.factory import check_backend_available, create_generation
from nemo_rl.models.generation.vllm import engine_setup as vllm_setup
from nemo_rl.models.generation.vllm import generation as vllm_generation
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"
TINY_EVAL_CONFIG = ROOT / "examples" / "configs" / "evals" / "tiny_math_eval.yaml"

# One row per built-in benchmark, in the columns its hub dataset has (answers as the hub stores them).
HUB_ROWS: dict[str, dict[str, Any]] = {
    "aime2024": {
        "id": 60,
        "problem": "Find x if x+1=2.",
        "solution": "x=1",
        "answer": "1",
        "url": "u",
        "year": "2024",
    },
    "aime2025": {"question": "Find the sum 2+3.", "answer": 5},
    "math500": {
        "problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?",
        "solution": "... $\\boxed{1}$",
        "answer": "1",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "test/algebra/1.json",
    },
    "gsm8k": {
        "question": "Tom has 1,200 apples and buys 34. How many?",
        "answer": "1200+34=1234\n#### 1,234",
    },
}
EXPECTED = {
    "aime2024": ("Find x if x+1=2.", "1"),
    "aime2025": ("Find the sum 2+3.", "5"),
    "math500": ("What is $\\frac{1}{2}+\\frac{1}{2}$?", "1"),
    "gsm8k": ("Tom has 1,200 apples and buys 34. How many?", "1234"),
}


def _write_jsonl(path: pathlib.Path, rows: Sequence[Mapping[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("name", sorted(HUB_ROWS))
def test_builtin_benchmark_from_a_local_copy(tmp_path: pathlib.Path, name: str) -> None:
    path = _write_jsonl(tmp_path / f"{name}.jsonl", [HUB_ROWS[name]] * 3)
    # NeMo RL spells them in capitals; either works.
    records = load_eval_records(EvalDataConfig(dataset_name=name.upper(), data_path=path))
    assert len(records) == 3
    problem, answer = EXPECTED[name]
    assert records[0]["messages"] == [{"role": "user", "content": problem}]
    assert records[0]["expected_answer"] == answer


def test_builtin_benchmark_from_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str | None]] = []

    def fake_hub(name: str, split: str, subset: str | None = None, *, key: str) -> list[dict[str, Any]]:
        calls.append((name, split, subset))
        return [HUB_ROWS["aime2025"]] * (15 if subset else 1)

    monkeypatch.setattr(eval_datasets, "load_hub_rows", fake_hub)
    # AIME 2025 is two hub configurations, concatenated.
    records = load_eval_records(EvalDataConfig(dataset_name="aime2025"))
    assert calls == [
        ("opencompass/AIME2025", "test", "AIME2025-I"),
        ("opencompass/AIME2025", "test", "AIME2025-II"),
    ]
    assert len(records) == 30
    assert "AIME2025-I+AIME2025-II" in records.source
    calls.clear()
    rows_by_hub = {"HuggingFaceH4/MATH-500": HUB_ROWS["math500"], "openai/gsm8k": HUB_ROWS["gsm8k"]}
    monkeypatch.setattr(
        eval_datasets,
        "load_hub_rows",
        lambda n, s, c=None, key="": calls.append((n, s, c)) or [rows_by_hub[n]],
    )
    load_eval_records(EvalDataConfig(dataset_name="math500", split="test"))
    load_eval_records(EvalDataConfig(dataset_name="gsm8k"))
    assert calls == [("HuggingFaceH4/MATH-500", "test", None), ("openai/gsm8k", "test", "main")]


def test_any_file_with_named_columns(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "math_500_test.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["Question", "Answer"])
        writer.writeheader()
        writer.writerows([{"Question": f"What is {i}+{i}?", "Answer": str(2 * i)} for i in range(5)])
    cfg = EvalDataConfig(
        dataset_name=str(path), problem_key="Question", solution_key="Answer", max_num_problems=3
    )
    records = load_eval_records(cfg)
    assert len(records) == 3
    assert records[2]["expected_answer"] == "4"
    with pytest.raises(
        MalformedRowError, match=r"math_500_test\.csv: line 2 \(row 0, 0-based\) has no 'problem'"
    ):
        load_eval_records(EvalDataConfig(dataset_name=str(path)))


def test_malformed_rows_and_missing_files(tmp_path: pathlib.Path) -> None:
    path = _write_jsonl(
        tmp_path / "gsm8k.jsonl", [HUB_ROWS["gsm8k"], {"question": "q", "answer": "no final answer"}]
    )
    with pytest.raises(
        MalformedRowError, match=r"gsm8k\.jsonl: line 2 \(row 1, 0-based\) .* final answer cannot be read"
    ):
        load_eval_records(EvalDataConfig(dataset_name="gsm8k", data_path=path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eval_records(EvalDataConfig(dataset_name=str(tmp_path / "missing.jsonl")))
    assert gsm8k_final_answer("so 3 #### 12,345,678") == "12345678"
    assert gsm8k_final_answer("#### -7") == "-7"


def test_tiny_math_held_out_split_is_the_recipes_validation_set() -> None:
    records = load_eval_records(EvalDataConfig(dataset_name="tiny_math", num_val_samples=256))
    training = load_dataset_splits(
        DataConfig(dataset_name="tiny_math", num_train_samples=4946, num_val_samples=256)
    )
    assert training.validation is not None
    assert list(records) == list(training.validation)
    assert not {r["messages"][0]["content"] for r in records} & {
        r["messages"][0]["content"] for r in training.train
    }


def test_prompts_carry_template_and_ground_truth(tmp_path: pathlib.Path) -> None:
    tokenizer = get_policy_tokenizer(PolicyConfig(model_name=str(TINY_SFT)))
    template = tmp_path / "prompt.txt"
    template.write_text("Q: {}\n")
    cfg = EvalDataConfig(
        dataset_name="tiny_math", num_val_samples=4, prompt_file=str(template), env_name="math"
    )
    dataset = setup_eval_data(cfg, tokenizer, max_total_sequence_length=64)
    sample = dataset[0]
    assert sample["task_name"] == "math"
    assert sample["extra_env_info"] == {"ground_truth": load_eval_records(cfg)[0]["expected_answer"]}
    text = "".join(m["content"] for m in sample["message_log"])
    assert text.startswith("<|bos|><|user|>Q: What is ") and text.endswith("<|assistant|>")


def test_eval_config_checks() -> None:
    with pytest.raises(ValueError, match=r"k_value=8 exceeds eval\.num_tests_per_prompt=4"):
        EvalMasterConfig.model_validate({"eval": {"k_value": 8, "num_tests_per_prompt": 4}})
    with pytest.raises(ValueError, match="temperature=0 decodes greedily"):
        EvalMasterConfig.model_validate({"eval": {"num_tests_per_prompt": 4}})
    with pytest.raises(ValueError, match=r"data\.data_path is for built-in datasets"):
        EvalDataConfig(dataset_name="my.jsonl", data_path="other.jsonl")
    with pytest.raises(ValueError, match="tiny_math is generated"):
        EvalDataConfig(dataset_name="tiny_math", data_path="x.jsonl")
    with pytest.raises(ValueError, match=r"in_policy_workers=true: evaluation trains no policy"):
        EvalMasterConfig.model_validate({"generation": {"embedded_cfg": {"in_policy_workers": True}}})
    ok = EvalMasterConfig.model_validate(
        {"eval": {"num_tests_per_prompt": 4, "k_value": 2}, "generation": {"temperature": 0.6}}
    )
    assert ok.data.builtin_name == "aime2024"


def test_the_tiny_eval_config_selects_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only generation.backend changes: run_eval's factory call builds the vLLM backend with the same model,
    # sampling settings and seed (a recorder stands in for the engines, which need a GPU).
    config = load_and_validate(TINY_EVAL_CONFIG, EvalMasterConfig, ["generation.backend=vllm"])
    model = resolve_model(config)
    built: dict[str, Any] = {}

    class Recorder:
        def __init__(self, cluster: Any, cfg: PolicyConfig, tokenizer: Any, **kwargs: Any) -> None:
            built.update(cfg=cfg, **kwargs)

    monkeypatch.setattr(vllm_setup, "installed_vllm_build", lambda: "cuda")
    monkeypatch.setattr(vllm_generation, "VllmGeneration", Recorder)
    generation = create_generation(
        SimpleNamespace(use_gpus=True),  # type: ignore[arg-type]
        generation_policy_config(config, model),
        tokenizer=None,  # type: ignore[arg-type]
        seed=config.eval.seed,
    )
    assert isinstance(generation, Recorder)
    cfg = built["cfg"]
    assert cfg.generation.backend == "vllm" and cfg.model_name == "examples/assets/tiny_math_sft"
    assert (cfg.generation.temperature, cfg.generation.max_new_tokens) == (1.0, 24)
    assert cfg.max_total_sequence_length == 64 and built["seed"] == 42
    # Without a GPU the script stops before starting anything, naming the fix.
    with pytest.raises(UserError, match=r"generation\.backend=vllm: .*needs CUDA GPUs.*tiny_math_eval\.yaml"):
        check_backend_available(
            generation_policy_config(config, model),
            cluster_has_gpus=False,
            key_prefix="generation",
            cpu_config="examples/configs/evals/tiny_math_eval.yaml",
        )
