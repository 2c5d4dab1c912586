"""On-policy distillation on math problems: the student samples, the teacher's top-k logits score it.

    uv run python examples/run_distillation_math.py [--config PATH] [key=value ...]

The default config, ``examples/configs/distillation_math.yaml``, is NeMo RL's recipe (Qwen3-4B teaching
Qwen3-1.7B-Base, vLLM on GPUs). ``examples/configs/distillation_tiny_math.yaml`` runs on any CPU: a tiny
teacher trained longer teaches the committed tiny checkpoint on the bundled arithmetic problems, sampled by
the embedded engine. A run resumes from the latest checkpoint in ``checkpointing.checkpoint_dir``.
"""

from __future__ import annotations

from pathlib import Path

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import DistillationMasterConfig
from nemo_rl.config.sources import check_model_source, check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "distillation_math.yaml"


def main() -> None:
    """Load and check the config, then set up and run distillation."""
    # Fewer garbage collections while torch and transformers are imported (see the module).
    use_gc_thresholds()
    config, _ = parse_args_and_load(DistillationMasterConfig, DEFAULT_CONFIG)

    # A model folder that does not exist is known from the path: say so before Ray starts.
    check_policy_sources(config.policy)
    check_model_source(config.teacher.model_name, "teacher.model_name")
    from nemo_rl.distributed.ray_start import ray_starting_in_background
    from nemo_rl.models.generation.backends import ray_may_start_in_background

    # Ray's processes come up while this process imports torch and loads the data (setup waits for them);
    # not for vLLM: a machine without a GPU must refuse it, below, without starting Ray.
    with ray_starting_in_background(config.cluster, start=ray_may_start_in_background(config.policy)):
        # Heavy imports only after the config is known to be valid, so config mistakes fail within seconds.
        from nemo_rl.algorithms.distillation import distillation_train, setup
        from nemo_rl.data.datasets import setup_rl_data
        from nemo_rl.distributed.device import cuda_available
        from nemo_rl.models.generation.factory import check_backend_available
        from nemo_rl.models.tokenizer import get_policy_tokenizer

        # Fail before starting any worker when the backend cannot run here (vLLM without a GPU).
        check_backend_available(
            config.policy,
            cluster_has_gpus=cuda_available(),
            cpu_config="examples/configs/distillation_tiny_math.yaml",
        )
        tokenizer = get_policy_tokenizer(config.policy)
        train_dataset, val_dataset = setup_rl_data(
            config.data,
            tokenizer,
            max_total_sequence_length=config.policy.max_total_sequence_length,
        )
        components = setup(config, tokenizer, train_dataset, val_dataset)
    try:
        distillation_train(components)
        print(f"Distillation finished at step {components.state.step}", flush=True)
    finally:
        components.shutdown()


if __name__ == "__main__":
    run_script(main)
