"""GRPO on math problems with a verifiable reward.

    uv run python examples/run_grpo_math.py [--config PATH] [key=value ...]

The default config, ``examples/configs/grpo_math_1B.yaml``, is the public recipe (Qwen2.5-1.5B,
OpenMathInstruct-2, vLLM on a GPU). ``examples/configs/grpo_math_tiny.yaml`` is the embedded default that runs
on any CPU: the committed tiny checkpoint, bundled arithmetic problems and the embedded generation engine.
A run resumes from the latest checkpoint in ``checkpointing.checkpoint_dir`` automatically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl.config.agent import check_agent_sources
from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.sources import check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_math_1B.yaml"


def main() -> None:
    """Load and check the config, then set up and run GRPO."""
    # Fewer garbage collections while torch and transformers are imported (see the module).
    use_gc_thresholds()
    config, _ = parse_args_and_load(GRPOMasterConfig, DEFAULT_CONFIG)
    # A model folder that does not exist is known from the path: say so before Ray starts.
    check_policy_sources(config.policy)
    check_agent_sources(config.grpo.agent)
    from nemo_rl.algorithms.rl_script import run_rl_script

    def load() -> tuple[Any, Any]:
        # Imported while Ray starts: torch and transformers only after the config is known to be valid.
        from nemo_rl.algorithms.grpo import grpo_train, setup

        return setup, grpo_train

    run_rl_script(config, "GRPO", load, cpu_config="examples/configs/grpo_math_tiny.yaml")


if __name__ == "__main__":
    run_script(main)
