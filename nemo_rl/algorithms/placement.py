"""Which worker slots (bundles of the run's cluster) each worker group of a run takes.

By default everything shares every slot and takes turns on it: the policy, its generation workers (colocated)
and the extra policies (a critic, a teacher). Non-colocated generation takes the last
``policy.generation.colocated.resources.gpus_per_node`` slots of each node; an extra policy with slots of its
own (PPO's critic with ``ppo.value_colocated.enabled: false``) takes its count on each node just before them.
The policy keeps the first slots of every node. A run whose work fits one slot may instead run in the driver's
process (:func:`single_process_refusal_of` says why not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.single_process import single_process_refusal
from nemo_rl.environments.registry import InDriverEnvironment

if TYPE_CHECKING:
    from nemo_rl.algorithms.run_build import SamplingSpec


@dataclasses.dataclass(frozen=True)
class Placement:
    """The bundle indices of a run's worker groups."""

    policy: list[int]
    """The trained policy's (and the extra policies' that share them)."""
    generation: list[int]
    """The generation workers' (the policy's when colocated; empty for a run that does not sample)."""
    own: dict[str, list[int]]
    """Extra policies with slots of their own, by name."""

    def of_extra(self, name: str) -> list[int]:
        """The slots of extra policy ``name``: its own, or the policy's."""
        return self.own.get(name, self.policy)


def placement(
    policy: PolicyConfig,
    cluster: ClusterConfig,
    *,
    samples: bool,
    own_slots_per_node: Mapping[str, int] | None = None,
) -> Placement:
    """Split the cluster's slots (see the module docstring); ``own_slots_per_node`` gives each extra policy that
    does not share the policy's slots its count per node (in the order of its keys)."""
    own = {name: n for name, n in (own_slots_per_node or {}).items() if n > 0}
    gen_per_node = 0
    if samples and not policy.generation.colocated.enabled:
        gen_per_node = policy.generation.colocated.resources.gpus_per_node or 0
    taken = gen_per_node + sum(own.values())
    if taken and taken >= cluster.gpus_per_node:
        others = " and ".join(
            [f"{name}'s {n}" for name, n in own.items()]
            + (
                [f"generation's {gen_per_node} (policy.generation.colocated.resources)"]
                if gen_per_node
                else []
            )
        )
        raise UserError(
            f"{others} slots per node leave none of cluster.gpus_per_node={cluster.gpus_per_node} for the "
            "policy: raise cluster.gpus_per_node or give the other workers fewer slots"
        )
    result = Placement(policy=[], generation=[], own={name: [] for name in own})
    for node in range(cluster.num_nodes):
        first = node * cluster.gpus_per_node
        end = first + cluster.gpus_per_node - taken
        result.policy.extend(range(first, end))
        for name, n in own.items():
            result.own[name].extend(range(end, end + n))
            end += n
        result.generation.extend(range(end, end + gen_per_node))
    if samples and not gen_per_node:
        result.generation.extend(result.policy)
    return result


def single_process_refusal_of(
    cluster: ClusterConfig,
    policy: PolicyConfig,
    *,
    sampling: SamplingSpec | None,
    extra_models: Sequence[str],
) -> str | None:
    """Why a run needs Ray (:func:`~nemo_rl.distributed.single_process.single_process_refusal`, plus what only the
    run's spec knows: environments or agents its caller brings); ``None`` when it fits the driver's process."""
    refusal = single_process_refusal(
        cluster,
        policy,
        samples=sampling is not None,
        extra_models=extra_models,
        reward_model_env=sampling is not None and sampling.env.reward_model.enabled,
    )
    if refusal is not None or sampling is None:
        return refusal
    given = [*(sampling.task_to_env or {}).values(), *(sampling.val_task_to_env or {}).values()]
    if any(not isinstance(env, InDriverEnvironment) for env in given):
        return "the caller passed environment actors"
    if sampling.agent is not None:
        return "external agents reach the generation workers through an endpoint"
    return None
