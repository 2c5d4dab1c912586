"""Environment registry: task / environment names to environment classes, and starting them as Ray actors.

Built in: ``math`` (:class:`~nemo_rl.environments.math_environment.MathEnvironment`), ``code``
(:class:`~nemo_rl.environments.code_environment.CodeEnvironment`), ``number_guessing``
(:class:`~nemo_rl.environments.games.number_guessing.NumberGuessingEnvironment`), ``reward_model``
(:class:`~nemo_rl.environments.reward_model_environment.RewardModelEnvironment`) and ``sliding_puzzle_game``
(:class:`~nemo_rl.environments.games.sliding_puzzle.SlidingPuzzleEnv`), and the vision-language environment
(:class:`~nemo_rl.environments.vlm_environment.VlmEnvironment`) under NeMo RL's names ``clevr-cogent``,
``geometry3k``, ``refcoco`` and ``vlm``, and ``tiny_clevr``. Add your own with
:func:`register_env`::

    class MyEnv(EnvironmentInterface[dict]):
        def __init__(self, cfg: MyEnvConfig) -> None: ...
        def step(self, message_log_batch, metadata) -> EnvironmentReturn[dict]: ...
        def global_post_process_and_metrics(self, batch): ...

    register_env("my_task", MyEnv)
    task_to_env = {"my_task": create_env("my_task", MyEnvConfig())}

Algorithms build one environment per task of their data with :func:`create_task_envs`, configured by the
``env.<task>`` section (a plain mapping for a user environment: ``env.my_task: {threshold: 0.5}``). A
rule-based built-in environment with ``env.<task>.in_driver: true`` (or any environment created with
``create_env(..., in_driver=True)``) runs in the driver process behind the same handle surface
(:class:`InDriverEnvironment`). An actor is held by a
:class:`~nemo_rl.environments.healing.HealingEnvironment`, which replaces it when it dies or hangs during a
call. Both are called the same way: ``env.call("step", message_logs, metadata).result()``
(:func:`as_env_handle` gives actors the caller started the same surface).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray
from ray.actor import ActorClass, ActorHandle

from nemo_rl.config.env import EnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.vlm_env import VLM_ENV_NAMES
from nemo_rl.distributed.single_process import LocalRef
from nemo_rl.environments.healing import ActorRecipe, DoneCall, EnvCall, HealingEnvironment, ReplacementBudget
from nemo_rl.environments.interfaces import EnvironmentInterface
from nemo_rl.environments.sandbox import check_sandbox

EnvClass = type[EnvironmentInterface[Any]] | ActorClass[Any]
"""A plain environment class (started with ``ray.remote``), or one already decorated with ``ray.remote``."""


class _InDriverMethod:
    """``method.remote(*args)`` of an :class:`InDriverEnvironment`."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        """Call the method now, on this thread, and return its result as a ref that
        :func:`~nemo_rl.distributed.single_process.resolve` reads (no object store: Ray may not be running)."""
        return LocalRef(self._method(*args, **kwargs))


class InDriverEnvironment:
    """An environment object in the driver process, behind the call surface of an environment actor.

    ``env.call(method, *args)`` (as :class:`HealingEnvironment` has it, what the algorithms call) calls the
    method at once, on the caller's thread; an exception is raised by that call itself.
    ``env.<method>.remote(*args)`` does the same and returns a
    :class:`~nemo_rl.distributed.single_process.LocalRef` of the result, which
    :func:`~nemo_rl.distributed.single_process.resolve` reads as it reads a Ray ref. :func:`wait_envs_started`
    and :func:`stop_envs` take it beside actors. It cannot be sent to another process (a Ray task or actor):
    start an actor for that.
    """

    def __init__(self, env: EnvironmentInterface[Any]) -> None:
        self.env = env
        """The environment object itself."""

    def call(self, method: str, *args: Any) -> EnvCall:
        """Call ``method(*args)`` now, on this thread (an error is raised here); ``result()`` returns its
        value. The same surface as :meth:`HealingEnvironment.call`."""
        return DoneCall(getattr(self.env, method)(*args))

    def __getattr__(self, name: str) -> _InDriverMethod:
        if name.startswith("__"):  # copy/pickle probes, not environment methods
            raise AttributeError(name)
        return _InDriverMethod(getattr(self.env, name))

    def __reduce__(self) -> Any:
        raise TypeError(
            f"an in-driver environment ({type(self.env).__name__}) cannot leave the driver process; create it "
            "as an actor (in_driver=False) to pass it to Ray tasks or actors"
        )

    def __repr__(self) -> str:
        return f"InDriverEnvironment({type(self.env).__name__})"


EnvHandle = HealingEnvironment | InDriverEnvironment
"""What :func:`create_env` returns: an actor that is replaced when it dies or hangs, or an environment in the
driver; call either with ``env.call(method, *args).result()``."""

# Built-ins are import paths so that importing the registry stays cheap (math-verify pulls in sympy).
_BUILTIN_ENVS: dict[str, str] = {
    "math": "nemo_rl.environments.math_environment:MathEnvironment",
    "code": "nemo_rl.environments.code_environment:CodeEnvironment",
    "number_guessing": "nemo_rl.environments.games.number_guessing:NumberGuessingEnvironment",
    "reward_model": "nemo_rl.environments.reward_model_environment:RewardModelEnvironment",
    "sliding_puzzle_game": "nemo_rl.environments.games.sliding_puzzle:SlidingPuzzleEnv",
    # NeMo RL's vision-language task names, each with a section of its own (nemo_rl.config.vlm_env).
    **{name: "nemo_rl.environments.vlm_environment:VlmEnvironment" for name in VLM_ENV_NAMES},
}
_REGISTRY: dict[str, EnvClass | str] = dict(_BUILTIN_ENVS)


def register_env(name: str, env_cls: EnvClass | str, *, overwrite: bool = False) -> None:
    """Make ``create_env(name, ...)`` start ``env_cls``.

    Args:
        name: Task / environment name (the ``task_name`` of the samples it scores).
        env_cls: An :class:`EnvironmentInterface` subclass, the same wrapped with ``ray.remote``, or its
            import path ``"package.module:ClassName"``.
        overwrite: Replace an existing registration instead of raising.
    """
    if not name:
        raise ValueError("an environment needs a non-empty name")
    if name in _REGISTRY and not overwrite:
        raise ValueError(
            f"an environment is already registered as {name!r}; pass overwrite=True to replace it"
        )
    if not isinstance(env_cls, str | ActorClass) and not (
        isinstance(env_cls, type) and issubclass(env_cls, EnvironmentInterface)
    ):
        raise TypeError(
            f"register_env({name!r}, ...) needs an EnvironmentInterface subclass (optionally wrapped with "
            f"ray.remote) or an import path 'module:Class'; got {env_cls!r}"
        )
    _REGISTRY[name] = env_cls


def registered_envs() -> list[str]:
    """Names :func:`create_env` accepts."""
    return sorted(_REGISTRY)


def get_env_class(name: str) -> EnvClass:
    """The class registered as ``name`` (imported on first use for import paths)."""
    if name not in _REGISTRY:
        raise KeyError(
            f"no environment registered as {name!r}; registered: {registered_envs()}. "
            "Register yours with nemo_rl.environments.registry.register_env(name, cls)."
        )
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ImportError(
                f"environment {name!r} is registered as {entry!r}, which does not import: {err}"
            ) from err
        _REGISTRY[name] = entry
    assert not isinstance(entry, str)
    return entry


def _section(name: str, cfg: Any) -> Any:
    """The config the environment's constructor takes: ``env.<name>`` when given the whole ``env`` section."""
    return cfg.section(name) if isinstance(cfg, EnvConfig) else cfg


def check_env_sections(env_cfg: EnvConfig) -> None:
    """Fail with a :class:`UserError` when an ``env.<name>`` section names no registered environment."""
    for name in env_cfg.user_sections():
        if name not in _REGISTRY:
            close = difflib.get_close_matches(name, registered_envs(), n=1)
            hint = f"did you mean env.{close[0]}? " if close else ""
            raise UserError(
                f"env.{name}: no environment is registered as {name!r} ({hint}registered: "
                f"{', '.join(registered_envs())}); register it with "
                f"nemo_rl.environments.registry.register_env({name!r}, cls) before setup, or remove the section"
            )


def check_task_envs(task_names: Iterable[str], env_cfg: EnvConfig) -> None:
    """What :func:`create_task_envs` checks, without starting anything: every ``env`` section and every
    task names a registered environment, and the ``code`` task's sandbox has an isolation that contains its
    runs, or was set to ``rlimits`` on purpose (else a :class:`UserError`). A task's ``tools`` are run by the
    rollout, not by its environment (see :func:`nemo_rl.environments.tools.build_task_tools`)."""
    check_env_sections(env_cfg)
    for task in sorted(set(task_names)):
        if task not in _REGISTRY:
            raise UserError(
                f"the data's task {task!r} has no registered environment (registered: "
                f"{', '.join(registered_envs())}); register one with "
                f"nemo_rl.environments.registry.register_env({task!r}, cls) or pass task_to_env to setup"
            )
        if task == "code":
            # Untrusted code runs contained or not at all: refused here, before any worker starts.
            check_sandbox(env_cfg.code.sandbox)


def create_task_envs(
    task_names: Iterable[str], env_cfg: EnvConfig, *, in_driver: bool | None = None
) -> dict[str, EnvHandle]:
    """One environment per task, each the environment registered under the task's name and configured by
    ``env.<task>`` (``{}`` for a user environment without a section): an actor, or in the driver where the
    section says ``in_driver: true``. ``in_driver`` overrides the sections (``True``: every one in the driver, as a
    run in one process needs). The actors share one budget of ``env.max_actor_replacements``.

    Raises:
        UserError: an ``env`` section or a task names no registered environment.
    """
    tasks = sorted(set(task_names))
    check_task_envs(tasks, env_cfg)
    budget = ReplacementBudget(env_cfg.max_actor_replacements)
    return {task: create_env(task, env_cfg, in_driver=in_driver, budget=budget) for task in tasks}


def create_env(
    name: str,
    cfg: Any,
    *,
    actor_options: Mapping[str, Any] | None = None,
    in_driver: bool | None = None,
    budget: ReplacementBudget | None = None,
) -> EnvHandle:
    """Start the environment registered as ``name`` as a Ray actor and return its handle (one that replaces the
    actor when it dies or hangs, see :mod:`nemo_rl.environments.healing`), or construct it in this process
    behind an :class:`InDriverEnvironment`.

    Args:
        name: A registered name (see :func:`registered_envs`).
        cfg: The whole ``env`` section (its ``name`` subsection is passed on, see :meth:`EnvConfig.section`;
            its ``actor_call_timeout_s`` and ``max_actor_replacements`` apply), or the environment's own
            config, handed to its constructor as is (those two keys then take their defaults).
        actor_options: Extra ``ray.remote`` options for the actor (``num_cpus``, ``runtime_env``...).
        in_driver: Construct the environment in this process instead of as an actor; ``None`` reads the
            config's ``in_driver`` (rule-based built-ins, see
            :class:`~nemo_rl.config.env.RuleBasedEnvConfig`; false for a config without it).
        budget: The replacements this actor may draw on, shared with others (``None``: a budget of its own,
            ``max_actor_replacements``).
    """
    env_cls = get_env_class(name)
    section = _section(name, cfg)
    if in_driver is None:
        in_driver = bool(getattr(section, "in_driver", False))
    if in_driver:
        if actor_options:
            raise ValueError(
                f"create_env({name!r}, ...): actor_options {sorted(actor_options)} apply to an actor, and this "
                "environment runs in the driver (in_driver); drop one of them"
            )
        # ray.remote keeps the class it wrapped: construct that one, not the actor class.
        plain_cls: Callable[[Any], EnvironmentInterface[Any]] = (
            env_cls.__ray_actor_class__  # type: ignore[attr-defined]  # set by ray.remote, not typed
            if isinstance(env_cls, ActorClass)
            else env_cls
        )
        return InDriverEnvironment(plain_cls(section))
    actor_cls = env_cls if isinstance(env_cls, ActorClass) else ray.remote(env_cls)
    healing = cfg if isinstance(cfg, EnvConfig) else EnvConfig()
    return HealingEnvironment.start(
        name,
        ActorRecipe(actor_cls, section, dict(actor_options or {})),
        call_timeout_s=healing.actor_call_timeout_s,
        budget=budget if budget is not None else ReplacementBudget(healing.max_actor_replacements),
    )


def as_env_handle(env: EnvHandle | ActorHandle[Any], name: str) -> EnvHandle:
    """``env`` with the surface callers use (``env.call(method, *args).result()``): as it is when
    :func:`create_env` made it; an actor handle the caller started, held as one that is not replaced (its
    death or hang during a call ends the run naming environment ``name``) and waited for
    ``env.actor_call_timeout_s``'s default."""
    if isinstance(env, HealingEnvironment | InDriverEnvironment):
        return env
    call_timeout_s = EnvConfig.model_fields["actor_call_timeout_s"].default
    return HealingEnvironment(name, env, None, call_timeout_s=call_timeout_s, budget=ReplacementBudget(0))


def wait_envs_started(envs: Iterable[EnvHandle], timeout_s: float) -> None:
    """Wait until every environment actor has finished its constructor (at most ``timeout_s`` in all).

    Start the environments before the workers and wait here after them: their starts overlap. A constructor
    that raised re-raises here (as Ray's ``ActorDiedError`` naming the environment's error). In-driver
    environments were constructed by :func:`create_env` already.
    """
    refs = [env.actor.__ray_ready__.remote() for env in envs if isinstance(env, HealingEnvironment)]
    if refs:
        ray.get(refs, timeout=timeout_s)


def stop_envs(envs: Iterable[EnvHandle], timeout_s: float) -> None:
    """Call each environment actor's ``shutdown`` (waiting at most ``timeout_s``), then kill it. An actor that
    already died is only killed: the error that ended the run named it, and the others still get stopped.
    An in-driver environment's ``shutdown`` is called directly."""
    for env in envs:
        if isinstance(env, InDriverEnvironment):
            env.env.shutdown()
        else:
            env.stop(timeout_s)
