"""PPO with a learned critic on math problems (or any environment) with a verifiable reward.

    uv run python examples/run_ppo.py [--config PATH] [key=value ...]

The default config, ``examples/configs/ppo_math_1B.yaml``, follows NeMo RL's PPO recipe (Qwen2.5-1.5B, vLLM
on a GPU); ``ppo_math_1B_megatron.yaml`` puts policy and critic on Megatron-core. ``ppo_math_tiny.yaml`` runs
on any CPU: the committed tiny checkpoint as policy and critic, bundled arithmetic problems and the embedded
generation engine. A run resumes policy and critic from the latest checkpoint in
``checkpointing.checkpoint_dir`` automatically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import PPOMasterConfig
from nemo_rl.config.sources import check_model_source, check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "ppo_math_1B.yaml"


def main() -> None:
    """Load and check the config, then set up and run PPO."""
    # Fewer garbage collections while torch and transformers are imported (see the module).
    use_gc_thresholds()
    config, _ = parse_args_and_load(PPOMasterConfig, DEFAULT_CONFIG)
    # A model folder that does not exist is known from the path: say so before Ray starts.
    check_policy_sources(config.policy)
    check_model_source(config.value.model_name, "value.model_name")
    from nemo_rl.algorithms.rl_script import run_rl_script

    def load() -> tuple[Any, Any]:
        # Imported while Ray starts: torch and transformers only after the config is known to be valid.
        from nemo_rl.algorithms.ppo import ppo_train, setup

        return setup, ppo_train

    run_rl_script(
        config, "PPO", load, cpu_config="examples/configs/ppo_math_tiny.yaml", extra_models=("critic",)
    )


if __name__ == "__main__":
    run_script(main)
