"""Supervised fine-tuning driver.

    uv run python examples/run_sft.py [--config PATH] [key=value ...]

The default config is ``examples/configs/sft.yaml``; ``examples/configs/sft_tiny_math.yaml`` trains the
embedded tiny model on CPU in a few minutes. A run resumes from the latest checkpoint in
``checkpointing.checkpoint_dir`` automatically.
"""

from __future__ import annotations

from pathlib import Path

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import SFTMasterConfig
from nemo_rl.config.sources import check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "sft.yaml"


def main() -> None:
    """Load and check the config, then set up and run SFT."""
    # Fewer garbage collections while torch and transformers are imported (see the module).
    use_gc_thresholds()
    config, _ = parse_args_and_load(SFTMasterConfig, DEFAULT_CONFIG)

    # A model folder that does not exist is known from the path: say so before Ray starts.
    check_policy_sources(config.policy)
    from nemo_rl.distributed.ray_start import ray_starting_in_background
    from nemo_rl.distributed.single_process import starts_in_one_process

    # Ray's processes come up while this process imports torch and loads the data (setup waits for them);
    # a mistake found before setup exits 2 at once, stopping them.
    # A run that fits one process (nemo_rl.distributed.single_process) starts no Ray.
    one_process = starts_in_one_process(config.cluster, config.policy, samples=False)
    with ray_starting_in_background(config.cluster, start=not one_process):
        # Heavy imports only after the config is known to be valid, so config mistakes fail within seconds.
        from nemo_rl.algorithms.sft import setup, sft_train
        from nemo_rl.data.datasets import setup_sft_data
        from nemo_rl.models.tokenizer import get_policy_tokenizer

        tokenizer = get_policy_tokenizer(config.policy)
        train_dataset, val_dataset = setup_sft_data(
            config.data, tokenizer, max_total_sequence_length=config.policy.max_total_sequence_length
        )
        components = setup(config, tokenizer, train_dataset, val_dataset)
    try:
        sft_train(components)
        print(f"SFT finished at step {components.state.step}", flush=True)
    finally:
        components.shutdown()


if __name__ == "__main__":
    run_script(main)
