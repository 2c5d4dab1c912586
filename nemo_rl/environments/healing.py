"""Environment actors that heal: one that dies or hangs during a call is replaced and the call made again.

An environment started as a Ray actor (:func:`nemo_rl.environments.registry.create_env`) is held by a
:class:`HealingEnvironment`, which keeps what started it: the actor class, its constructor argument and its
``ray.remote`` options. Callers call it through ``env.call(method, *args)``, which sends the call at once, and
read the answer with :meth:`EnvCall.result`. When the actor dies during the call (``RayActorError``: its
process was killed, crashed or ran out of memory) or has not answered within ``env.actor_call_timeout_s`` (a
hang: the actor is killed first), a new actor of the same class is started with the same argument and
options, and the call is sent to it again. That is safe because an environment's calls are functions of
their arguments: an episode's state travels in its ``metadata`` (see
:mod:`nemo_rl.environments.interfaces`). State a custom environment keeps inside its actor starts afresh
in the replacement.

The environments of a run share one :class:`ReplacementBudget` (``env.max_actor_replacements``). Each
replacement prints one line (``WARNING: environment 'math' actor died during step (...); replaced (1 of 3
replacements)``); past the budget the call raises :class:`EnvironmentActorError`, one line that ends the run
(exit status 2 under the scripts' ``run_cli``). An error the environment's own code raises is not a death: it
is raised by :meth:`EnvCall.result` as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol, cast

import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from nemo_rl.config.errors import UserError

REPLACEMENT_START_TIMEOUT_S = 600.0
"""Longest wait for a replacement actor's constructor (the run's environments get as long to start)."""


class EnvironmentActorError(RuntimeError, UserError):
    """An environment actor died or hung and could not be replaced (the run's replacements are used up, or
    the caller started the actor); the message names the environment and what happened."""


class EnvCall(Protocol):
    """A call sent to an environment; :meth:`result` waits for its answer."""

    replacements: int
    """Actors replaced while this call was waited for (0 for an environment in the driver)."""

    def result(self) -> Any:
        """The call's value; the environment's own error is raised as it is."""
        ...


class DoneCall:
    """A call already answered (an environment in the driver runs it on the caller's thread)."""

    replacements = 0

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> Any:
        """The value the call returned."""
        return self._value


class ReplacementBudget:
    """How many environment actors a run may still replace (``env.max_actor_replacements``), shared by the
    run's environments. Thread-safe: asynchronous GRPO's rollout thread calls environments too."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        """Replacements allowed in all."""
        self.used = 0
        """Replacements made so far."""
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Count one replacement; ``False`` (and nothing counted) when none is left."""
        with self._lock:
            if self.used >= self.limit:
                return False
            self.used += 1
            return True


@dataclasses.dataclass(frozen=True)
class ActorRecipe:
    """What starts an environment actor: its class, constructor argument and ``ray.remote`` options."""

    actor_cls: ActorClass[Any]
    config: Any
    options: Mapping[str, Any]

    def start(self) -> ActorHandle[Any]:
        """A new actor (its constructor runs in the background; wait on ``__ray_ready__``)."""
        return cast(ActorHandle[Any], self.actor_cls.options(**dict(self.options)).remote(self.config))


class HealingEnvironment:
    """An environment actor that is replaced when it dies or hangs during a call (see the module docstring).

    ``recipe`` ``None``: an actor the caller started, which the run cannot start again; its death or hang
    during a call raises :class:`EnvironmentActorError` (and a hung one is left to its owner).
    """

    def __init__(
        self,
        name: str,
        actor: ActorHandle[Any],
        recipe: ActorRecipe | None,
        *,
        call_timeout_s: float,
        budget: ReplacementBudget,
    ) -> None:
        self.name = name
        """The environment's (task's) name, as messages show it."""
        self.call_timeout_s = call_timeout_s
        """Longest wait for one call before the actor counts as hung."""
        self.budget = budget
        """The replacements the run has left (shared by its environments)."""
        self._actor = actor
        self._recipe = recipe
        self._stopped = False
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, name: str, recipe: ActorRecipe, *, call_timeout_s: float, budget: ReplacementBudget
    ) -> HealingEnvironment:
        """Start the actor of ``recipe`` (without waiting for its constructor)."""
        return cls(name, recipe.start(), recipe, call_timeout_s=call_timeout_s, budget=budget)

    @property
    def actor(self) -> ActorHandle[Any]:
        """The actor that serves calls now (a replacement after a death or a hang)."""
        return self._actor

    def call(self, method: str, *args: Any) -> EnvCall:
        """Send ``method(*args)`` to the actor now; ``result()`` waits for the answer, replacing the actor and
        sending the call again when it dies or hangs."""
        return _HealingCall(self, method, args)

    def replace(self, failed: ActorHandle[Any], what: str) -> tuple[ActorHandle[Any], bool]:
        """The actor to send a call again to, after ``failed`` ``what`` (``"died during step (...)"``), and
        whether this call replaced it: a new one when ``failed`` still serves (it is killed first), the one
        that already replaced it otherwise.

        Raises:
            EnvironmentActorError: the actor cannot be replaced (the budget is used up, the caller started
                it, or its replacement failed to start).
        """
        with self._lock:
            if failed is not self._actor:  # another call saw it fail and replaced it already
                return self._actor, False
            if self._recipe is None:
                raise EnvironmentActorError(
                    f"environment {self.name!r} actor {what}; the caller started it, so the run cannot start "
                    "it again: pass environments that stay up, or let the run start them from env.<task>"
                )
            if self._stopped:  # the run is ending: a call still waiting must not start an actor
                raise EnvironmentActorError(f"environment {self.name!r} actor {what}; it was stopped")
            if not self.budget.take():
                raise EnvironmentActorError(
                    f"environment {self.name!r} actor {what}, and the run has no environment actor "
                    f"replacement left (env.max_actor_replacements={self.budget.limit}, all used): find why "
                    "it fails in its log (Ray's session logs), then rerun to resume from the last checkpoint or "
                    "raise env.max_actor_replacements"
                )
            ray.kill(failed)  # a hung actor holds its slot and may wake up; a dead one is unaffected
            self._actor = self._started_replacement(what)
            print(
                f"WARNING: environment {self.name!r} actor {what}; replaced ({self.budget.used} of "
                f"{self.budget.limit} replacements)",
                flush=True,
            )
            return self._actor, True

    def _started_replacement(self, what: str) -> ActorHandle[Any]:
        """A new actor of the recipe whose constructor has finished (so that the call sent again gets the
        whole call timeout to answer)."""
        assert self._recipe is not None
        actor = self._recipe.start()
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=REPLACEMENT_START_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as err:
            ray.kill(actor)
            raise EnvironmentActorError(
                f"environment {self.name!r} actor {what}, and its replacement failed to start "
                f"({_first_line(err)}); the run stops (the last checkpoint is intact)"
            ) from err
        return actor

    def stop(self, timeout_s: float) -> None:
        """Call the actor's ``shutdown`` (waiting at most ``timeout_s``), then kill it. A dead actor is only
        killed: the error that ended the run named it, and the others still get stopped. A call still waiting
        on it then fails instead of starting a replacement."""
        with self._lock:
            self._stopped = True
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(self._actor.shutdown.remote(), timeout=timeout_s)
        ray.kill(self._actor)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"environment {self.name!r} replaces its actor from the driver and cannot leave it; pass "
            "env.actor to a Ray task or actor (that handle is not replaced when the actor dies)"
        )

    def __repr__(self) -> str:
        return f"HealingEnvironment({self.name!r})"


class _HealingCall:
    """One call of a :class:`HealingEnvironment`, sent again to each replacement of its actor."""

    def __init__(self, env: HealingEnvironment, method: str, args: tuple[Any, ...]) -> None:
        self.replacements = 0
        self._env = env
        self._method = method
        self._args = args
        self._send(env.actor)

    def _send(self, actor: ActorHandle[Any]) -> None:
        self._actor = actor
        self._deadline = time.monotonic() + self._env.call_timeout_s
        self._ref = getattr(actor, self._method).remote(*self._args)

    def result(self) -> Any:
        """The call's value (see :meth:`HealingEnvironment.call`)."""
        while True:
            try:
                return ray.get(self._ref, timeout=max(self._deadline - time.monotonic(), 0.0))
            except RayActorError as err:
                # An actor the environment itself calls (the reward model's workers) died: starting the
                # environment again starts those again.
                how = "lost an actor it calls" if isinstance(err, RayTaskError) else "died"
                what = f"{how} during {self._method} ({_first_line(err)})"
            except GetTimeoutError:
                what = f"did not answer {self._method} within {self._env.call_timeout_s:g} s (hung)"
            actor, replaced = self._env.replace(self._actor, what)
            self.replacements += replaced
            self._send(actor)


def _first_line(err: BaseException) -> str:
    """The first line of Ray's (long) report of an actor's death."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
