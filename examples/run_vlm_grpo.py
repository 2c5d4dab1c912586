"""GRPO of a vision-language model on prompts with images and a verifiable reward.

    uv run python examples/run_vlm_grpo.py [--config PATH] [--dry-run] [key=value ...]

The default config is ``examples/configs/vlm_grpo_tiny.yaml``: the tiny Qwen2.5-VL of ``examples/assets``,
warmed up by SFT on the generated ``tiny_clevr`` counting pictures, learning from the counting verifier's 0/1
reward, sampled by the embedded engine, on CPU. NeMo RL's ``vlm_grpo_3B.yaml`` (Qwen2.5-VL-3B-Instruct on
CLEVR-CoGenT, vLLM on GPUs) runs as it is. Every image is checked before Ray starts its workers, and a bad one
ends the run with one line naming the row and the file. A run resumes from the latest checkpoint in
``checkpointing.checkpoint_dir`` automatically. docs/algorithms/vlm.md has the details.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.sources import check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "vlm_grpo_tiny.yaml"


def check_vlm_grpo_config(config: GRPOMasterConfig) -> None:
    """Refuse, with one line, what this script does not run: text data, and external agents (their
    endpoint speaks text-only chat)."""
    if not config.data.multimodal:
        raise UserError(
            f"data.dataset_name={config.data.dataset_name} is text: set data.processor=vlm_hf_data_processor "
            "for multimodal chats, or run examples/run_grpo_math.py"
        )
    if config.grpo.agent.enabled:
        raise UserError(
            "grpo.agent.enabled=true: external agents roll out through a text-only chat endpoint, which "
            "cannot carry the prompts' images; set grpo.agent.enabled=false"
        )


def main() -> None:
    """Load and check the config, then set up and run GRPO on the images."""
    use_gc_thresholds()
    config, _ = parse_args_and_load(GRPOMasterConfig, DEFAULT_CONFIG)
    check_vlm_grpo_config(config)
    check_policy_sources(config.policy)
    from nemo_rl.algorithms.rl_script import run_rl_script

    def load() -> tuple[Any, Any]:
        # Imported while Ray starts: torch and transformers only after the config is known to be valid.
        from nemo_rl.algorithms.grpo import grpo_train, setup

        return setup, grpo_train

    def setup_data(cfg: GRPOMasterConfig, tokenizer: Any) -> tuple[Any, Any]:
        # The model's own processor reads the images; every image is checked here, before any worker starts.
        from nemo_rl.data.vlm import load_hf_processor
        from nemo_rl.data.vlm_prompts import setup_vlm_rl_data

        return setup_vlm_rl_data(
            cfg.data,
            tokenizer,
            load_hf_processor(cfg.policy),
            max_total_sequence_length=cfg.policy.max_total_sequence_length,
        )

    run_rl_script(
        config, "GRPO", load, cpu_config="examples/configs/vlm_grpo_tiny.yaml", setup_data=setup_data
    )


if __name__ == "__main__":
    run_script(main)
