"""Supervised fine-tuning of a vision-language model (conversations with images).

    uv run python examples/run_vlm_sft.py [--config PATH] [key=value ...]

The default config is ``examples/configs/vlm_sft_tiny.yaml``: the tiny Qwen2.5-VL of ``examples/assets``
learning to count the shapes of the generated ``tiny_clevr`` pictures, on CPU. The model's own Hugging Face
processor turns each image into patches (``nemo_rl.data.vlm``); every image is checked before Ray starts
its workers, and a bad one ends the run with one line naming the row and the file. A run resumes from the
latest checkpoint in ``checkpointing.checkpoint_dir`` automatically. docs/algorithms/vlm.md has the details.
"""

from __future__ import annotations

from pathlib import Path

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import SFTMasterConfig
from nemo_rl.config.sources import check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "vlm_sft_tiny.yaml"


def main() -> None:
    """Load and check the config and the images, then set up and run SFT."""
    use_gc_thresholds()
    config, _ = parse_args_and_load(SFTMasterConfig, DEFAULT_CONFIG)
    if not config.data.multimodal:
        raise UserError(
            f"data.dataset_name={config.data.dataset_name} is text: set data.processor=vlm_hf_data_processor "
            "for multimodal chats, or run examples/run_sft.py"
        )
    check_policy_sources(config.policy)
    from nemo_rl.distributed.ray_start import ray_starting_in_background
    from nemo_rl.distributed.single_process import starts_in_one_process

    # A run that fits one process (nemo_rl.distributed.single_process) starts no Ray.
    one_process = starts_in_one_process(config.cluster, config.policy, samples=False)
    with ray_starting_in_background(config.cluster, start=not one_process):
        from nemo_rl.algorithms.sft import setup, sft_train
        from nemo_rl.data.vlm import load_hf_processor, setup_vlm_sft_data
        from nemo_rl.models.tokenizer import get_policy_tokenizer

        tokenizer = get_policy_tokenizer(config.policy)
        train_dataset, val_dataset = setup_vlm_sft_data(
            config.data,
            tokenizer,
            load_hf_processor(config.policy),
            max_total_sequence_length=config.policy.max_total_sequence_length,
        )
        components = setup(config, tokenizer, train_dataset, val_dataset)
    try:
        sft_train(components)
        print(f"SFT finished at step {components.state.step}", flush=True)
    finally:
        components.shutdown()


if __name__ == "__main__":
    run_script(main)
