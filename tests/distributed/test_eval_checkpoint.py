"""Evaluating a training checkpoint (DCP) directly, and converting one to a Hugging Face folder.

The checkpoint is the committed tiny SFT model with its final norm doubled (a sharper model), written the
way a training run lays it out: ``step_<N>/policy/weights`` (DCP) next to the run's ``config.yaml``.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nemo_rl.config.master import EvalMasterConfig
from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.data.datasets.eval_datasets import setup_eval_data
from nemo_rl.evals.eval import load_eval_tokenizer, resolve_model, run_env_eval, setup
from nemo_rl.models.policy.dcp_io import convert_dcp_to_hf, find_training_checkpoint
from nemo_rl.models.tokenizer import get_tokenizer

TINY_SFT = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_math_sft"
TIMEOUT_S = 120
CONVERTER = Path(__file__).resolve().parents[2] / "examples" / "converters" / "convert_dcp_to_hf.py"


def _training_checkpoint(step_dir: Path) -> dict[str, torch.Tensor]:
    """Write a sharpened tiny model as a training checkpoint; return the weights written."""
    model = AutoModelForCausalLM.from_pretrained(TINY_SFT, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(step_dir / "policy" / "weights"), no_dist=True)
    run_config = {
        "grpo": {"max_num_steps": 3},
        "policy": {"model_name": str(TINY_SFT), "precision": "float32"},
    }
    (step_dir / "config.yaml").write_text(yaml.safe_dump(run_config))
    return state


def _eval_config(model_name: str) -> EvalMasterConfig:
    return EvalMasterConfig.model_validate(
        {
            "eval": {"num_tests_per_prompt": 1, "greedy_accuracy": False},
            "generation": {
                "backend": "embedded",
                "model_name": model_name,
                "max_total_sequence_length": 64,
                "max_new_tokens": 24,
                "temperature": 0.0,
                "embedded_cfg": {"precision": "float32"},
            },
            "data": {"dataset_name": "tiny_math", "num_val_samples": 8},
            "env": {"math": {"num_workers": 1}},
            "logger": {
                "jsonl_enabled": False,
                "console_enabled": False,
                "monitor_gpus": False,
                "plot_metrics": [],
            },
        }
    )


def test_eval_reads_a_training_checkpoint_directly(ray_cluster: Any, tmp_path: Path) -> None:
    written = _training_checkpoint(tmp_path / "step_3")
    # Either the step folder or its weights folder names the checkpoint.
    for name in (tmp_path / "step_3", tmp_path / "step_3" / "policy" / "weights"):
        assert resolve_model(_eval_config(str(name))).checkpoint is not None
    config = _eval_config(str(tmp_path / "step_3"))
    model = resolve_model(config)
    assert model.model_name == str(TINY_SFT)
    tokenizer = load_eval_tokenizer(config, model)
    dataset = setup_eval_data(config.data, tokenizer, max_total_sequence_length=64)
    components = setup(config, tokenizer, dataset, model)
    try:
        held = ray.get(components.generation.workers[0].named_weights.remote(), timeout=TIMEOUT_S)
        for name, tensor in held.items():
            assert torch.equal(tensor, written[name]), name
        result = run_env_eval(components)
    finally:
        components.shutdown()
    assert result.metrics["num_problems"] == 8
    assert all("\\boxed{" in p.responses[0] for p in result.problems)
    # Greedy decoding: pass@1 is the greedy accuracy.
    assert result.metrics["greedy_accuracy"] == result.metrics["pass@1"]


def test_convert_dcp_to_hf(tmp_path: Path) -> None:
    written = _training_checkpoint(tmp_path / "step_3")
    out = convert_dcp_to_hf(find_training_checkpoint(tmp_path / "step_3"), tmp_path / "hf")
    # The script with NeMo RL's command line writes the same folder, in the precision asked for.
    converter = runpy.run_path(str(CONVERTER))
    weights = tmp_path / "step_3" / "policy" / "weights"
    converter["main"](
        [
            "--config",
            str(tmp_path / "step_3" / "config.yaml"),
            "--dcp-ckpt-path",
            str(weights),
            "--hf-ckpt-path",
            str(tmp_path / "hf_bf16"),
            "--dtype",
            "bfloat16",
        ]
    )
    halved = load_file(tmp_path / "hf_bf16" / "model.safetensors")
    assert halved["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(halved["model.norm.weight"].float(), written["model.norm.weight"].bfloat16().float())
    saved = load_file(out / "model.safetensors")
    # Tied embeddings are stored once, as from_pretrained expects.
    assert set(saved) == set(written) - {"lm_head.weight"}
    for name, tensor in saved.items():
        assert torch.equal(tensor, written[name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, written["model.embed_tokens.weight"])
    # The run's tokenizer (the character-level one, not the Qwen2 class AutoTokenizer would pick) goes along.
    run_tokenizer = get_tokenizer(
        TokenizerConfig(name=str(TINY_SFT)), model_name=None, trust_remote_code=False
    )
    converted = get_tokenizer(TokenizerConfig(name=str(out)), model_name=None, trust_remote_code=False)
    assert converted.chat_template == run_tokenizer.chat_template
    assert converted.encode("What is 12+7?") == run_tokenizer.encode("What is 12+7?")
