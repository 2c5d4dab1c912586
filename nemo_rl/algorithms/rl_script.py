"""The body of the example scripts whose loop samples from a dataset (``run_grpo_math.py``, ``run_ppo.py``,
``run_distillation_math.py``): start Ray in the background, import the algorithm, check the generation backend,
load the tokenizer and the data, set up, train, shut down.

Nothing heavy is imported at this module's top: a script imports it right after validating its config, and
torch, transformers and the algorithm come in while Ray's processes start (``load`` imports the algorithm).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nemo_rl.algorithms.run import Run
    from nemo_rl.config.master import DistillationMasterConfig, GRPOMasterConfig, PPOMasterConfig

    SamplingConfig = GRPOMasterConfig | DistillationMasterConfig | PPOMasterConfig


class Setup(Protocol):
    """An algorithm's ``setup(config, tokenizer, train_dataset, val_dataset)``."""

    def __call__(self, config: Any, tokenizer: Any, train_dataset: Any, val_dataset: Any, /) -> Run[Any, Any]:
        """Start the run's workers and return it."""
        ...


def run_rl_script(
    config: SamplingConfig,
    name: str,
    load: Callable[[], tuple[Setup, Callable[[Any], object]]],
    *,
    cpu_config: str,
    extra_models: Sequence[str] = (),
) -> None:
    """Run the algorithm ``load()`` imports (its ``setup`` and its train function) on ``config``'s data.

    A mistake found before setup (bad data, a task with no environment, a check that needs the tokenizer)
    ends the process with its one line at once, stopping what Ray's start began. ``cpu_config`` is the recipe
    the error for a GPU-only backend on a machine without a GPU points to; ``extra_models`` names the policies the
    algorithm runs beside the trained one (a critic, a teacher). A run that fits one process
    (:mod:`nemo_rl.distributed.single_process`) starts no Ray.
    """
    from nemo_rl.distributed.ray_start import ray_starting_in_background
    from nemo_rl.distributed.single_process import starts_in_one_process
    from nemo_rl.models.generation.backends import ray_may_start_in_background

    # Ray's processes come up while this process imports torch and loads the data (setup waits for them).
    # Not for vLLM, whose start takes far longer anyway: a machine without a GPU must refuse it (below) as
    # quickly as possible, without starting Ray.
    one_process = starts_in_one_process(
        config.cluster,
        config.policy,
        samples=True,
        extra_models=extra_models,
        reward_model_env=config.env.reward_model.enabled,
    )
    start_ray = ray_may_start_in_background(config.policy) and not one_process
    with ray_starting_in_background(config.cluster, start=start_ray):
        setup, train = load()
        from nemo_rl.data.datasets import setup_rl_data
        from nemo_rl.distributed.device import cuda_available
        from nemo_rl.models.generation.factory import check_backend_available
        from nemo_rl.models.tokenizer import get_policy_tokenizer

        # Fail before starting any worker when the backend cannot run here (vLLM without a GPU).
        check_backend_available(config.policy, cluster_has_gpus=cuda_available(), cpu_config=cpu_config)
        tokenizer = get_policy_tokenizer(config.policy)
        train_dataset, val_dataset = setup_rl_data(
            config.data,
            tokenizer,
            max_total_sequence_length=config.policy.max_total_sequence_length,
        )
        run = setup(config, tokenizer, train_dataset, val_dataset)
    try:
        train(run)
        print(f"{name} finished at step {run.state.step}", flush=True)
    finally:
        run.shutdown()
