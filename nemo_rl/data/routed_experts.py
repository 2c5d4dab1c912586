"""The name a sampler's MoE routing (routing replay) travels under, from generation outputs through the
rollout's token tensors (:mod:`nemo_rl.experience.rollout_tokens`, which merges the routing of successive
generation calls) into the training batch and the policy's forwards.

Its value is ``[B, T, L, K]`` int16 (L = MoE layers, K = experts per token): the experts the sampler's routers
chose for each token, -1 where no forward ran the token.
"""

ROUTED_EXPERTS_KEY = "routed_experts"
"""The key of the routing in generation outputs, rolled-out batches and the training batch (NeMo RL's name)."""
