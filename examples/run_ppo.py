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
    from nemo_rl.distributed.ray_start import ray_starting_in_background
    from nemo_rl.models.generation.backends import ray_may_start_in_background

    # Ray's processes come up while this process imports torch and loads the data (setup waits for them).
    # Not for vLLM, whose start takes far longer anyway: a machine without a GPU must refuse it (below) as
    # quickly as possible, without starting Ray. A mistake found before setup (bad data, a task with no
    # environment, a check that needs the tokenizer) exits 2 at once, stopping what the start began.
    with ray_starting_in_background(config.cluster, start=ray_may_start_in_background(config.policy)):
        # Heavy imports only after the config is known to be valid, so config mistakes fail within seconds.
        from nemo_rl.algorithms.ppo import ppo_train, setup
        from nemo_rl.data.datasets import setup_rl_data
        from nemo_rl.distributed.device import cuda_available
        from nemo_rl.models.generation.factory import check_backend_available
        from nemo_rl.models.tokenizer import get_policy_tokenizer

        # Fail before starting any worker when the backend cannot run here (vLLM without a GPU).
        check_backend_available(
            config.policy, cluster_has_gpus=cuda_available(), cpu_config="examples/configs/ppo_math_tiny.yaml"
        )
        tokenizer = get_policy_tokenizer(config.policy)
        train_dataset, val_dataset = setup_rl_data(
            config.data,
            tokenizer,
            max_total_sequence_length=config.policy.max_total_sequence_length,
        )
        components = setup(config, tokenizer, train_dataset, val_dataset)
    try:
        ppo_train(components)
        print(f"PPO finished at step {components.state.step}", flush=True)
    finally:
        components.shutdown()


if __name__ == "__main__":
    run_script(main)
