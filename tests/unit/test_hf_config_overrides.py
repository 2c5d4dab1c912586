"""``policy.hf_config_overrides`` reach every builder of the model: the policy workers' Hugging Face config,
the embedded engine's decoder and vLLM's engine arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.generation.vllm.engine_setup import OWNED_ENGINE_ARGS, engine_kwargs
from nemo_rl.models.hf_config import load_hf_config
from nemo_rl.models.policy import hf_io

TINY = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_math_sft"
OVERRIDES = {
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"},
}


def test_policy_and_embedded_generation_build_the_overridden_model() -> None:
    cfg = PolicyConfig(model_name=str(TINY), hf_config_overrides=OVERRIDES)
    hf_config = hf_io.load_hf_config(cfg)
    assert hf_config.max_position_embeddings == 1024
    assert hf_config.rope_parameters["rope_theta"] == 500.0
    assert hf_io.load_hf_config(PolicyConfig(model_name=str(TINY))).max_position_embeddings == 256

    plain = DecoderLM.from_pretrained(TINY, dtype=torch.float32)
    overridden = DecoderLM.from_pretrained(TINY, dtype=torch.float32, config_overrides=OVERRIDES)
    assert overridden.arch.rope_parameters["rope_theta"] == 500.0 != plain.arch.rope_parameters["rope_theta"]
    ids = torch.tensor([[5, 6, 7, 8]])
    # Same weights, other rotary frequencies: the first position agrees, later ones differ.
    plain_logits, new_logits = plain.forward(ids), overridden.forward(ids)
    assert torch.allclose(plain_logits[:, 0], new_logits[:, 0], atol=1e-5)
    assert not torch.allclose(plain_logits[:, -1], new_logits[:, -1], atol=1e-3)


def test_an_attribute_the_config_lacks_fails_naming_the_closest() -> None:
    with pytest.raises(UserError, match=r"policy.hf_config_overrides.max_position_embedding \(did you mean "):
        load_hf_config(TINY, overrides={"max_position_embedding": 512})


def test_vllm_receives_them_as_hf_overrides() -> None:
    cfg = PolicyConfig.model_validate(
        {
            "model_name": "org/model",
            "hf_config_overrides": {"max_position_embeddings": 1024},
            "generation": {"backend": "vllm", "vllm_cfg": {"gpu_memory_utilization": 0.5}},
        }
    )
    kwargs = engine_kwargs(cfg, model="m", tokenizer="m", seed=0)
    assert kwargs["hf_overrides"] == {"max_position_embeddings": 1024}
    assert "hf_overrides" in OWNED_ENGINE_ARGS
    assert "hf_overrides" not in engine_kwargs(PolicyConfig(model_name="m"), model="m", tokenizer="m", seed=0)


# A fresh process: ``import transformers`` scans its model folder (one cache miss per subfolder), and
# ``transformers.models`` (imported by ``AutoConfig``) scanned it a second time under another cache key.
ONE_SCAN = """
import sys
import transformers
from transformers.utils import import_utils
from nemo_rl.models.hf_config import load_hf_config
scan = import_utils.create_import_structure_from_path
first = scan.cache_info().misses
config = load_hf_config(sys.argv[1])
print(type(config).__name__, first, scan.cache_info().misses - first)
"""


def test_a_worker_scans_the_transformers_model_folder_once() -> None:
    out = subprocess.run(
        [sys.executable, "-c", ONE_SCAN, str(TINY)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    config_class, first, later = out[0], int(out[1]), int(out[2])
    assert config_class == "Qwen2Config"
    assert first > 400  # hundreds of model subfolders
    # Only the Qwen2 package's own folder is scanned again, not the whole tree.
    assert later < 10, (first, later)
