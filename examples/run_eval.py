"""Evaluate a model on a benchmark: pass@k, cons@k (majority vote), greedy accuracy and response lengths.

    uv run python examples/run_eval.py [--config PATH] [key=value ...]

The default config, ``examples/configs/evals/eval.yaml``, is NeMo RL's (Qwen2.5-Math-1.5B-Instruct on
AIME 2024, greedy, vLLM on a GPU). ``examples/configs/evals/tiny_math_eval.yaml`` evaluates the committed tiny
checkpoint on the held-out arithmetic problems on any CPU, and ``examples/configs/evals/tiny_clevr_eval.yaml`` a
tiny vision-language checkpoint on the held-out counting pictures (``data.blank_images=true``: the same pictures
blanked). ``generation.model_name`` may be a Hugging Face
folder or hub name, or a training checkpoint (``<checkpoint_dir>/step_<N>``), read directly.
"""

from __future__ import annotations

from pathlib import Path

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import EvalMasterConfig
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "evals" / "eval.yaml"


def main() -> None:
    """Load and check the config, then set up the model and data and run the evaluation."""
    # Fewer garbage collections while torch and transformers are imported (see the module).
    use_gc_thresholds()
    config, _ = parse_args_and_load(EvalMasterConfig, DEFAULT_CONFIG)

    # Heavy imports only after the config is known to be valid, so config mistakes fail within seconds.
    from nemo_rl.data.datasets.eval_datasets import setup_eval_data
    from nemo_rl.distributed.device import cuda_available
    from nemo_rl.evals.eval import (
        generation_policy_config,
        load_eval_tokenizer,
        resolve_model,
        run_env_eval,
        setup,
    )
    from nemo_rl.models.generation.factory import check_backend_available

    model = resolve_model(config)
    # Fail before starting any worker when the backend cannot run here (vLLM without a GPU).
    check_backend_available(
        generation_policy_config(config, model),
        cluster_has_gpus=cuda_available(),
        key_prefix="generation",
        cpu_config="examples/configs/evals/tiny_math_eval.yaml",
    )
    tokenizer = load_eval_tokenizer(config, model)
    if config.data.multimodal:
        # Pictures go through the model's own processor (images blanked with data.blank_images).
        from nemo_rl.data.vlm import load_hf_processor
        from nemo_rl.data.vlm_prompts import setup_vlm_eval_data

        dataset = setup_vlm_eval_data(
            config.data,
            tokenizer,
            load_hf_processor(generation_policy_config(config, model)),
            max_total_sequence_length=config.generation.max_total_sequence_length,
        )
    else:
        dataset = setup_eval_data(
            config.data,
            tokenizer,
            max_total_sequence_length=config.generation.max_total_sequence_length,
        )
    components = setup(config, tokenizer, dataset, model)
    try:
        run_env_eval(components)
    finally:
        components.shutdown()


if __name__ == "__main__":
    run_script(main)
