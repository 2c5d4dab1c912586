"""The refit settings live in the policy schema (``policy.refit``); re-exported here for the transports."""

from nemo_rl.config.policy import RefitConfig

__all__ = ["RefitConfig"]
