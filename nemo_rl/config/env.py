"""Schema of the ``env`` section: one subsection per environment (``env.math``, ``env.code``,
``env.number_guessing``, ``env.reward_model``, ``env.sliding_puzzle_game``), and the limits of the code sandbox
(:class:`SandboxConfig`) that the code environment and the ``python`` tool run under.

Environments registered by users (``nemo_rl.environments.registry.register_env``) take their constructor
arguments from a subsection of their own name, e.g. ``env.exact_match: {threshold: 0.5}``; such sections are
plain mappings, checked against the registry when an algorithm builds its environments.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import ConfigDict, Field, ValidationError, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import (
    DTensorConfig,
    DynamicBatchingConfig,
    PolicyConfig,
    Precision,
    RewardModelConfig,
    TokenizerConfig,
)
from nemo_rl.config.vlm_env import VLM_ENV_NAMES, vlm_env_config


class SandboxConfig(ConfigModel):
    """Limits of one run of untrusted code (:class:`nemo_rl.environments.sandbox.Sandbox`); see
    docs/security.md for what each one does and does not promise."""

    isolation: Literal["auto", "bubblewrap", "rlimits"] = "auto"
    """How runs are contained. ``auto`` and ``bubblewrap``: under bubblewrap (new PID, network, IPC and mount
    namespaces, a read-only view of only the interpreter's files, as root a uid of its own); where bubblewrap
    is missing or cannot make namespaces the run stops at start with one line that says what to do.
    ``rlimits``: resource limits and a process session only, on purpose; that does NOT contain a program
    (it can read the filesystem and reach other processes and the network stack: docs/security.md), and a
    warning says so each time a sandbox starts."""

    wall_time_limit_s: float = Field(default=10.0, gt=0.0)
    """Longest a run may take by the clock (sleeping counts); then everything it started is killed (under
    bubblewrap within a second of the limit, whatever it started)."""

    cpu_time_limit_s: int = Field(default=5, ge=1)
    """CPU seconds a process of the run may use (``RLIMIT_CPU``); then the kernel kills it."""

    memory_limit_mb: int = Field(default=1024, ge=64)
    """Address-space limit of each process of the run (``RLIMIT_AS``), in MiB; an allocation past it fails."""

    file_size_limit_mb: int = Field(default=16, ge=1)
    """Largest file a run may write (``RLIMIT_FSIZE``), in MiB."""

    max_processes: int = Field(default=32, ge=2)
    """Processes (and threads) a run may have at once (``RLIMIT_NPROC`` under a user id of its own)."""

    max_open_files: int = Field(default=64, ge=16)
    """File descriptors each process of the run may hold (``RLIMIT_NOFILE``)."""

    max_output_bytes: int = Field(default=65_536, ge=1)
    """Bytes of stdout plus stderr kept; a run that writes more is killed and its output marked cut."""

    python_executable: str | None = None
    """Interpreter that runs Python code (``None``: the one running nemo_rl, with its installed packages)."""


class RuleBasedEnvConfig(ConfigModel):
    """What every rule-based environment (scoring by code, no model) accepts besides its own settings."""

    in_driver: bool = False
    """Run the environment in the driver process instead of as a Ray actor of its own. That saves the actor's
    process start (a Ray worker importing torch: seconds of CPU competing with the policy workers' start on a
    small machine) and a Ray call per step; its ``step`` then runs on the driver's thread, so it fits scoring
    that takes milliseconds (answer checks that need more, math-verify's, still run in the environment's
    verifier processes). Environments passed to an algorithm by the caller are used as given."""

    tools: list[str] = Field(default_factory=list)
    """Tools the policy may call in this task's rollouts: built-in names (``calculator``, ``python``) or
    ``module:function`` paths of your own (a :class:`nemo_rl.environments.tools.Tool`, or a function with a
    Google-style docstring from which its JSON schema is derived). The prompts declare them
    (``apply_chat_template(tools=...)``); the rollout runs every ``<tool_call>`` of a generated turn and
    appends the results as a tool turn, and the environment scores the first turn that calls no tool (see
    docs/algorithms/agents.md). Needs a turn budget above 1 (``grpo.max_rollout_turns``)."""

    max_tool_response_length: int = Field(default=256, ge=1)
    """Characters of one tool result the model reads (verl's ``multi_turn.max_tool_response_length``); a
    longer result is cut on ``tool_response_truncate_side`` and marked ``...(truncated)...``."""

    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of a long tool result is kept (verl's key): ``left`` its start, ``right`` its end,
    ``middle`` both ends."""

    max_parallel_calls: int = Field(default=1, ge=1)
    """Tool calls of one generated turn that run (verl's key); each further call of the turn gets an error
    result saying so."""

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Limits of the code this environment runs: the ``python`` tool's calls and the code environment's
    tests (one sandbox run per call or per response)."""


class MathEnvConfig(RuleBasedEnvConfig):
    """The math environment: the response's final answer checked against the ground truth, by math-verify or
    DAPO's rule (``math_verify_impl``)."""

    num_workers: int = Field(default=8, ge=1)
    """Verifier processes checking answers in parallel."""

    verify_timeout_s: float = Field(default=10.0, gt=0.0)
    """Longest time one answer may take to verify; a slower answer counts as wrong and its verifier process
    is killed and replaced."""

    verify_memory_limit_mb: int | None = Field(default=4096, ge=64)
    """Address-space limit of each verifier process, in MiB; an answer whose check needs more counts as wrong
    (``None``: no limit)."""

    max_response_chars: int | None = Field(default=20_000, ge=1)
    """Responses are cut to their last this many characters (where the final answer is) before the answer
    is extracted and checked, which bounds both (``None``: no cap)."""

    stop_strings: list[str] | None = None
    """Stop strings for the response (``None``: stop at end of sequence only)."""

    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = "hf_math_verify"
    """How answers are checked (NeMo RL's key). ``hf_math_verify``: the last ``\\boxed{}`` answer, compared
    mathematically by Hugging Face math-verify in the verifier processes. ``dapo_math_verify``: DAPO's rule
    (for its ``Answer:``-line prompts, e.g. ``DAPOMath17K``): the last ``Answer:`` line of the response's last
    300 characters, normalised the Minerva way, must equal the normalised ground truth as text; it runs in
    the environment, so ``num_workers``, ``verify_timeout_s`` and ``verify_memory_limit_mb`` do not apply."""


class CodeEnvConfig(RuleBasedEnvConfig):
    """The code environment: the response's last Python code block runs against the problem's unit tests in
    the sandbox; the reward is the fraction of tests that pass."""

    num_workers: int = Field(default=4, ge=1)
    """Sandboxed test runs in flight at once."""

    stop_strings: list[str] | None = None
    """Stop strings for the response (``None``: stop at end of sequence only)."""


class NumberGuessingEnvConfig(RuleBasedEnvConfig):
    """A multi-turn game: the assistant guesses a hidden integer and is told "higher", "lower" or "correct"."""

    max_guesses: int = Field(default=5, ge=1)
    """Guesses allowed per game (unparsable replies count); the game ends after the last one."""

    low: int = 1
    """Smallest number the hidden number can be."""

    high: int = 20
    """Largest number the hidden number can be."""

    stop_strings: list[str] | None = None
    """Stop strings for each guess (``None``: stop at end of sequence only)."""

    @model_validator(mode="after")
    def _check_range(self) -> Self:
        if self.low > self.high:
            raise ValueError(f"env.number_guessing.low ({self.low}) must not exceed high ({self.high})")
        return self


class SlidingPuzzleGameConfig(ConfigModel):
    """The puzzles of a sliding-puzzle run (NeMo RL's ``env.sliding_puzzle_game.cfg.game_config``): each is
    a solved board scrambled by random moves of the blank."""

    size: int = Field(default=4, ge=2)
    """Largest board side; NeMo RL's sliding-puzzle script draws each puzzle's side from ``2..size``."""

    shuffle_moves: int = Field(default=100, ge=1)
    """Most random moves scrambling a board; the script draws each puzzle's count from ``1..shuffle_moves``
    (made odd, so no puzzle starts solved)."""


class SlidingPuzzleSettings(ConfigModel):
    """Settings of the sliding-puzzle environment (NeMo RL's ``env.sliding_puzzle_game.cfg``)."""

    game_config: SlidingPuzzleGameConfig = Field(default_factory=SlidingPuzzleGameConfig)
    """How puzzles are generated."""

    max_moves: int = Field(default=50, ge=1)
    """Moves (actions, including unreadable replies) allowed per game; the game ends unsolved after the
    last."""


class SlidingPuzzleEnvConfig(RuleBasedEnvConfig):
    """The sliding-puzzle game (multi-turn): the assistant slides tiles until the board is in order."""

    cfg: SlidingPuzzleSettings = Field(default_factory=SlidingPuzzleSettings)
    """The environment's settings (NeMo RL nests them under ``cfg``)."""


class RewardModelEnvConfig(ConfigModel):
    """A trained reward model as the reward of RL: its workers score each finished conversation (NeMo RL's
    ``env.reward_model``). The model runs on its own Ray workers and placement groups (``resources``),
    like the policy's, and reads the conversation as the policy's chat template rendered it."""

    enabled: bool = False
    """Start the reward-model environment; GRPO then scores samples of the task ``reward_model`` with it."""

    model_name: str | None = None
    """Hub name or local path of a Hugging Face sequence-classification model with one output (e.g. the
    export of ``examples/run_rm.py``)."""

    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """Tokenizer of the reward model (``name: null`` uses ``model_name``)."""

    precision: Precision = "float32"
    """Dtype the reward model computes in (``bfloat16`` on GPUs)."""

    batch_size: int = Field(default=32, ge=1)
    """Conversations per forward pass on one reward-model worker."""

    checkpoint_path: str | None = None
    """Sharded weights of a training checkpoint (``<checkpoint_dir>/step_<N>/policy/weights``) loaded over
    ``model_name``; ``None`` uses ``model_name``'s own weights."""

    max_model_len: int = Field(default=2048, ge=2)
    """Longest conversation scored, in tokens of the reward model's tokenizer; longer ones are cut at the
    end and scored on what is left."""

    resources: ClusterConfig = Field(default_factory=ClusterConfig)
    """Worker slots of the reward model (GPUs, or CPU slots without CUDA), reserved next to the run's own
    ``cluster``."""

    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    """Parallelism of the reward-model workers (tensor parallel size...)."""

    reward_model_cfg: RewardModelConfig = Field(default_factory=lambda: RewardModelConfig(enabled=True))
    """Kind of reward model; ``enabled`` must stay true and ``reward_model_type`` ``bradley_terry``."""

    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    """Token-budget micro-batches for scoring (``logprob_mb_tokens`` bounds a forward pass)."""

    max_grad_norm: None = None
    """Accepted for NeMo RL recipes; the environment never trains, so only ``null``."""

    trust_remote_code: bool = False
    """Allow the reward model's repository to run its own code."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.enabled and self.model_name is None:
            raise ValueError("env.reward_model.enabled=true needs env.reward_model.model_name")
        if not self.reward_model_cfg.enabled:
            raise ValueError(
                "env.reward_model.reward_model_cfg.enabled must be true: the environment loads a reward model"
            )
        if self.reward_model_cfg.reward_model_type != "bradley_terry":
            raise ValueError(
                "env.reward_model.reward_model_cfg.reward_model_type=regression is PPO's value model, which scores "
                "every token rather than a response: set it to bradley_terry (or leave it out)"
            )
        return self

    def policy_config(self) -> PolicyConfig:
        """The reward model's worker config (scoring only: no optimizer steps are ever taken)."""
        if self.model_name is None:
            raise ValueError("env.reward_model.model_name is not set")
        tp = self.dtensor_cfg.tensor_parallel_size
        return PolicyConfig(
            model_name=self.model_name,
            tokenizer=self.tokenizer,
            trust_remote_code=self.trust_remote_code,
            train_global_batch_size=self.batch_size,
            train_micro_batch_size=self.batch_size,
            logprob_batch_size=self.batch_size,
            max_total_sequence_length=self.max_model_len,
            precision=self.precision,
            max_grad_norm=None,
            make_sequence_length_divisible_by=tp if self.dtensor_cfg.sequence_parallel else 1,
            dtensor_cfg=self.dtensor_cfg,
            reward_model_cfg=self.reward_model_cfg,
            dynamic_batching=self.dynamic_batching,
        )


class EnvConfig(ConfigModel):
    """Environments that score rollouts; each subsection configures the environment of that name. A
    subsection with another name is the constructor config (a mapping) of a user-registered environment."""

    # Sections of user-registered environments are not known to the schema; the registry checks them.
    model_config = ConfigDict(extra="allow")

    math: MathEnvConfig = Field(default_factory=MathEnvConfig)
    """The math (verifiable answer) environment."""

    code: CodeEnvConfig = Field(default_factory=CodeEnvConfig)
    """The code environment (unit tests run in a sandbox)."""

    number_guessing: NumberGuessingEnvConfig = Field(default_factory=NumberGuessingEnvConfig)
    """The number-guessing game (multi-turn)."""

    reward_model: RewardModelEnvConfig = Field(default_factory=RewardModelEnvConfig)
    """A trained reward model scoring responses."""

    sliding_puzzle_game: SlidingPuzzleEnvConfig = Field(default_factory=SlidingPuzzleEnvConfig)
    """The sliding-puzzle game (multi-turn; ``examples/run_grpo_sliding_puzzle.py``)."""

    max_actor_replacements: int = Field(default=3, ge=0)
    """Environment actors the run may replace in all: an actor that dies or hangs during a call is killed,
    started again with the same arguments and the call is made again on the new actor (docs/reliability.md).
    Past this many the run stops with one line naming the environment; ``0``: the first death stops it.
    Environments that run in the driver (``in_driver``) or that the caller passed in are never replaced."""

    actor_call_timeout_s: float = Field(default=600.0, gt=0.0)
    """Longest an environment actor may take to answer one call (a step, or the metrics of a batch), counted
    from when the call is sent, before it counts as hung and is replaced like a dead one (or, past
    ``max_actor_replacements``, ends the run)."""

    @model_validator(mode="after")
    def _check_user_sections(self) -> Self:
        for name, value in (self.model_extra or {}).items():
            if not isinstance(value, dict):
                raise ValueError(
                    f"env.{name} must be a mapping of the environment's constructor arguments, got {value!r}"
                )
            if name in VLM_ENV_NAMES:
                _check_vlm_section(name, value)
        return self

    def section(self, name: str) -> Any:
        """The config of environment ``name``: its schema section, a vision-language environment's
        :class:`~nemo_rl.config.vlm_env.VlmEnvConfig`, its user section (a dict), or ``{}``."""
        if name in self.schema_sections():
            return getattr(self, name)
        if name in VLM_ENV_NAMES:
            return vlm_env_config(name, (self.model_extra or {}).get(name))
        return dict((self.model_extra or {}).get(name, {}))

    @classmethod
    def schema_sections(cls) -> list[str]:
        """Names of the environments the schema declares a section for (not the keys that apply to every
        environment, such as ``max_actor_replacements``)."""
        return [
            name
            for name, field in cls.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, ConfigModel)
        ]

    def tool_sections(self) -> dict[str, RuleBasedEnvConfig]:
        """The environments whose ``tools`` list is not empty, by name."""
        sections = {name: getattr(self, name) for name in self.schema_sections()}
        return {
            name: section
            for name, section in sections.items()
            if isinstance(section, RuleBasedEnvConfig) and section.tools
        }

    def check_tool_turns(self, max_rollout_turns: int, key: str) -> None:
        """Refuse tools with a one-turn budget: a tool call could never be answered (``key`` names the turn
        budget's setting)."""
        tool_sections = self.tool_sections()
        if tool_sections and max_rollout_turns < 2:
            name = sorted(tool_sections)[0]
            raise ValueError(
                f"env.{name}.tools={tool_sections[name].tools} needs turns to answer the tool calls in, but "
                f"{key}={max_rollout_turns}: set {key} to 2 or more (one turn per tool call plus the answer)"
            )

    def user_sections(self) -> list[str]:
        """Names of the sections the schema does not declare (user-registered environments)."""
        return sorted(self.model_extra or {})


def _check_vlm_section(name: str, value: dict[str, Any]) -> None:
    """Validate a vision-language environment's section now, so a bad key fails the config load."""
    try:
        vlm_env_config(name, value)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"env.{name}.{where}: {first['msg']}") from None
