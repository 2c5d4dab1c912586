"""Schema of the vision-language environments' sections (NeMo RL's ``env.clevr-cogent``, ``env.geometry3k``,
``env.refcoco``, ``env.vlm``, and ``env.tiny_clevr`` for the generated counting pictures).

Their names are not Python identifiers (``clevr-cogent``), so they stay mappings under ``env`` as NeMo RL
writes them; :func:`vlm_env_config` reads one into a :class:`VlmEnvConfig` when the ``env`` section is
validated (a bad key fails the config load) and again when the environment is built. A section left out takes
its environment's default reward functions (:data:`DEFAULT_REWARD_FUNCTIONS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from nemo_rl.config.base import ConfigModel

RewardFunctionName = Literal["format", "exact_alnum", "math_expr", "bbox_giou", "boxed_integer"]
"""The reward functions of a vision-language environment (``nemo_rl.environments.vlm_rewards``):

- ``format``: 0.25 for a ``<think>...</think>`` span and 0.75 for an ``<answer>...</answer>`` span;
- ``exact_alnum``: 1 when the ``<answer>`` text equals the ground truth, letters and digits only, any case;
- ``math_expr``: 1 when the ``<answer>`` text equals the ground truth mathematically (math-verify);
- ``bbox_giou``: the generalised IoU of the ``<answer>`` box ``[x1, y1, x2, y2]`` with the ground truth's;
- ``boxed_integer``: 1 when the last ``\\boxed{}`` holds exactly the ground truth's integer (CLEVR counting).
"""


class RewardFunctionConfig(ConfigModel):
    """One term of an environment's reward (NeMo RL's ``env.<name>.reward_functions`` entries)."""

    name: RewardFunctionName
    """Which function (see :data:`RewardFunctionName`)."""

    weight: float = Field(gt=0.0)
    """Its share of the reward; the weights of an environment are renormalised to sum to 1."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the function (``answer_tag``, ``think_tag``, ``giou_penalty_thres``)."""


class VlmEnvConfig(ConfigModel):
    """A vision-language environment: each response scored by a weighted sum of reward functions against the
    sample's ``ground_truth`` (single turn)."""

    num_workers: int = Field(default=1, ge=1)
    """Accepted for NeMo RL recipes, no effect here: the reward functions are string checks of microseconds
    (math-verify's aside), run in the environment itself."""

    stop_strings: list[str] | None = None
    """Stop strings for the response (``None``: stop at end of sequence only)."""

    in_driver: bool = False
    """Run the environment in the driver process instead of as a Ray actor (see
    :class:`nemo_rl.config.env.RuleBasedEnvConfig`)."""

    reward_functions: list[RewardFunctionConfig] = Field(min_length=1)
    """The reward's terms; a response is counted correct when every term that judges correctness
    (all but ``format``) says so."""


_CLEVR = [{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}]
DEFAULT_REWARD_FUNCTIONS: dict[str, list[dict[str, Any]]] = {
    "tiny_clevr": [{"name": "boxed_integer", "weight": 1.0}],
    "clevr-cogent": _CLEVR,
    "vlm": _CLEVR,
    "geometry3k": [{"name": "format", "weight": 0.1}, {"name": "math_expr", "weight": 0.9}],
    "refcoco": [
        {"name": "format", "weight": 0.1},
        {"name": "bbox_giou", "weight": 0.9, "kwargs": {"giou_penalty_thres": 0.5}},
    ],
}
"""The reward functions of each vision-language environment whose section leaves ``reward_functions`` out
(those of NeMo RL's ``vlm_grpo_3B.yaml``; ``tiny_clevr`` scores the boxed count of ``\\boxed{N}`` answers)."""

VLM_ENV_NAMES: tuple[str, ...] = tuple(DEFAULT_REWARD_FUNCTIONS)
"""The names the vision-language environment is registered under."""


def vlm_env_config(name: str, section: Mapping[str, Any] | VlmEnvConfig | None) -> VlmEnvConfig:
    """``env.<name>`` of a vision-language environment as a :class:`VlmEnvConfig` (its default reward
    functions where the section gives none)."""
    if isinstance(section, VlmEnvConfig):
        return section
    values = dict(section or {})
    values.setdefault("reward_functions", DEFAULT_REWARD_FUNCTIONS[name])
    return VlmEnvConfig.model_validate(values)
