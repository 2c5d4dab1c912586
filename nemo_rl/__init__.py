"""nemo_rl: Ray-orchestrated post-training (GRPO, SFT and friends) for language models."""

import os

# Under `uv run`, Ray's uv hook would rebuild the project environment for every worker from an uploaded copy
# of the working directory. Workers here run the driver's own interpreter and code (the same node, or a
# shared filesystem on a cluster), so the hook only costs start-up time. It must be decided before `ray` is
# imported; export RAY_ENABLE_UV_RUN_RUNTIME_ENV=1 to get Ray's behaviour back.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
