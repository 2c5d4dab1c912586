"""A training checkpoint (DCP) named as the evaluated model, and its conversion to a Hugging Face folder.

The checkpoint is the committed tiny SFT model with its final norm doubled (a sharper model), written the
way a training run lays it out: ``step_<N>/policy/weights`` (DCP) next to the run's ``config.yaml``.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nemo_rl.config.master import EvalMasterConfig
from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.evals.eval import resolve_model
from nemo_rl.models.policy.dcp_io import convert_dcp_to_hf, find_training_checkpoint
from nemo_rl.models.tokenizer import get_tokenizer

TINY_SFT = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_math_sft"
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


def test_a_training_checkpoint_resolves_to_its_base_model_and_weights(tmp_path: Path) -> None:
    _training_checkpoint(tmp_path / "step_3")
    # Either the step folder or its weights folder names the checkpoint.
    for name in (tmp_path / "step_3", tmp_path / "step_3" / "policy" / "weights"):
        config = EvalMasterConfig.model_validate({"generation": {"model_name": str(name)}})
        model = resolve_model(config)
        assert model.checkpoint is not None and model.model_name == str(TINY_SFT)
        assert model.checkpoint.weights_dir == tmp_path / "step_3" / "policy" / "weights"
    # The evaluation workers start from the run's base model with the checkpoint's weights over it: see
    # tests/functional/test_eval_tiny.py, which evaluates a checkpoint through run_eval.py.


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
