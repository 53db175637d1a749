"""`PopulationBasedTraining`: exploit and explore across a population's members
at host points (Jaderberg et al., 2017)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._members import member_key
from pztrain.callbacks._base import Callback
from pztrain.callbacks._monitored import eval_owner, eval_value
from pztrain.population import population_size, set_member_hyperparams
from pztrain.records import LoopInfo

if TYPE_CHECKING:
    from pztrain.state import TrainState

__all__ = ["PopulationBasedTraining"]

_KEEP = ("step", "root_rng")  # a member keeps its own key: copies must not share
_ONE = re.compile(r"/member_\d+$")  # a member's entry of a metric


class PopulationBasedTraining(Callback):
    """Population-based training: at every ``every``-th evaluation (or train log
    point), the members ranked worst by ``monitor`` take over the weights and
    optimizer state of members ranked best (exploit), then their injected
    hyperparameters are multiplied by one of the factors ``perturb`` lists,
    picked at random (explore).

    A replaced member copies everything of its source (params, optimizer
    state, with the source's hyperparameters, loss-function state, the arrays
    of ``model_without_params``) but its root key, so copies do not share their
    randomness afterwards. Decisions are a pure function of ``seed``, the step
    and the ranking, so a resumed run makes the same ones. Each decision is
    added to the record that prompted it, so loggers keep it:
    ``pbt/source/member_<i>`` (the member whose state member ``i`` now holds,
    itself if kept) and ``pbt/replaced``; `decisions` keeps them too.

    Args:
      monitor: A metric of the records, with a value per member: ``"eval/<name>"``
        (read after evaluations; a named evaluation's ``"eval/<evaluation>/
        <name>"``, read only at the points where that evaluation ran) or a
        train metric (read at log points).
      mode: ``"min"`` or ``"max"``: which values are best.
      fraction: The share of members replaced (the worst) and copied (the
        best) at each decision, at least one each.
      perturb: Injected hyperparameter name → the factors to choose from (not
        a range): each replaced member's value is multiplied by one of them,
        picked at random. Default ``{"learning_rate": (0.8, 1.25)}``: times
        0.8 or times 1.25, never a factor in between.
      every: Decide at every ``every``-th evaluation (of the monitored one)
        or log point.
      seed: Seeds the draws (sources among the best, factors).

    Attributes:
      decisions: One dict per decision: ``step``, ``sources`` (per member) and
        the hyperparameters after it.

    Example:
      >>> from pztrain import PopulationBasedTraining
      >>> import jax, jax.numpy as jnp, numpy as np, optax, pztrain
      >>> def init(seed):
      ...     tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      ...     w = jax.random.normal(jax.random.key(seed), (2,))
      ...     key = jax.random.key(seed)
      ...     return pztrain.TrainState.initial_state({"w": w}, tx, key)
      ...
      >>> pop = pztrain.make_population(init, seeds=range(4),
      ...                               learning_rate=[1e-3, 1e-2, 1e-1, 3e-1])
      >>> def loss_fn(*, model, state, rng, x):
      ...     loss = jnp.mean((x @ model["w"] - 1.0) ** 2)
      ...     return loss, state, {}
      ...
      >>> pbt = PopulationBasedTraining("loss", fraction=0.25, seed=0)
      >>> data = pztrain.ArrayLoader({"x": np.ones((32, 2), np.float32)}, batch_size=8)
      >>> pop, history = pztrain.fit(pop, pztrain.build_train_step(loss_fn), data,
      ...                            num_steps=20, log_every=10, callbacks=[pbt],
      ...                            progress=False)
      >>> [(d["step"], d["sources"]) for d in pbt.decisions]  # who took whose state
      [(10, [2, 1, 2, 3]), (20, [0, 3, 2, 3])]
      >>> round(pbt.decisions[0]["learning_rate"][0], 3)  # 0.1 from member 2, x 0.8
      0.08
    """

    train_metrics = ("pbt/replaced", "pbt/source")

    def __init__(
        self,
        monitor: str = "eval/loss",
        *,
        mode: str = "min",
        fraction: float = 0.25,
        perturb: Mapping[str, Sequence[float]] | None = None,
        every: int = 1,
        seed: int = 0,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}.")
        if not 0 < fraction <= 0.5:
            raise ValueError(f"fraction must be in (0, 0.5]; got {fraction!r}.")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1; got {every!r}.")
        split, _, name = monitor.partition("/")
        self.on_eval = split == "eval" and bool(name)
        self.metric = name if self.on_eval else monitor
        self.monitor, self.mode, self.fraction = monitor, mode, fraction
        self.perturb = {"learning_rate": (0.8, 1.25)} if perturb is None else perturb
        self.perturb = {k: tuple(float(f) for f in v) for k, v in self.perturb.items()}
        self.every, self.seed = every, seed
        self.decisions: list[dict[str, Any]] = []
        self._seen = 0
        self._evaluations: tuple[str, ...] = ("",)  # fit's, from on_train_start

    def on_train_start(self, state: TrainState, info: LoopInfo) -> None:
        self._evaluations = tuple(info.evaluation_names)

    def check(self, state: TrainState, info: LoopInfo) -> None:
        """Refuses a run this callback cannot act on, before anything is written:
        a single run or a population of one, ``perturb`` names the optimizer
        does not inject, an eval monitor in a run without evaluations or
        naming none of its evaluations (``"eval/<name>/<metric>"``).

        Raises:
          ValueError: naming the problem and what to do.
        """
        size = population_size(state)
        if size is None or size < 2:
            raise ValueError(
                "PopulationBasedTraining needs a population of at least 2 members "
                "(pztrain.make_population); got a single run's state."
            )
        unknown = sorted(set(self.perturb) - set(state.hyperparams))
        if unknown:
            raise ValueError(
                f"PopulationBasedTraining(perturb=...) names {unknown}, which the "
                f"optimizer does not inject; injected: {sorted(state.hyperparams)} "
                "(wrap the optimizer in optax.inject_hyperparams)."
            )
        if self.on_eval and not info.evaluates:
            raise ValueError(
                f"PopulationBasedTraining monitors {self.monitor!r}, but the run "
                "does not evaluate: pass eval_step= and eval_data= to fit, or "
                "monitor a train metric."
            )
        try:
            eval_owner(self.monitor, tuple(info.evaluation_names))
        except ValueError as e:
            raise ValueError(f"PopulationBasedTraining: {e}") from None

    def on_log(self, state: TrainState, record: dict[str, Any]) -> Any:
        return None if self.on_eval else self._maybe_decide(state, record)

    def on_eval_end(self, state: TrainState, record: dict[str, Any]) -> Any:
        if not (self.on_eval and self._ran(record)):
            return None
        return self._maybe_decide(state, record)

    def _ran(self, record: dict[str, Any]) -> bool:
        """Whether the monitored evaluation ran at this eval point (named
        evaluations keep their own cadences): a decision is made only there."""
        record = {"split": "eval", **record}
        with contextlib.suppress(KeyError):  # it ran without the metric: named later
            monitor = member_key(self.monitor, 0)
            return eval_value(record, monitor, self._evaluations) is not None
        return True

    def _maybe_decide(self, state: TrainState, record: dict[str, Any]) -> Any:
        self._seen += 1
        if self._seen % self.every:
            return None
        values = self._values(record["metrics"], population_size(state))
        sources, factors = self.plan(values, record["step"])
        new = _exploit(state, sources)
        new = _explore(new, sources, factors)
        self._note(record, sources, new)
        return new

    def _values(self, metrics: Mapping[str, float], size: int) -> np.ndarray:
        keys = [member_key(self.metric, i) for i in range(size)]
        missing = [k for k in keys if k not in metrics]
        if missing:
            split = "eval/" if self.on_eval else ""
            valid = sorted(
                {f"{split}{k.rpartition('/')[0]}" for k in metrics if _ONE.search(k)}
            )
            raise KeyError(
                f"PopulationBasedTraining: the record has no {missing[0]!r} (monitor "
                f"{self.monitor!r}); the metrics with a value per member it can "
                f"monitor here are {valid}."
            )
        values = np.array([metrics[k] for k in keys], np.float64)
        values[~np.isfinite(values)] = np.inf if self.mode == "min" else -np.inf
        return values if self.mode == "min" else -values

    def plan(self, values: np.ndarray, step: int):
        """``(sources, factors)`` for lower-is-better ``values`` at ``step``:
        member ``i`` takes member ``sources[i]``'s state; ``factors[name][i]``
        multiplies its hyperparameter (1 for the kept members)."""
        size = len(values)
        n = max(1, int(self.fraction * size))
        order = np.argsort(values, kind="stable")
        best, worst = order[:n], order[-n:]
        rng = np.random.default_rng([self.seed, int(step)])
        sources = np.arange(size)
        sources[worst] = rng.choice(best, size=n)
        factors = {}
        for name, choices in self.perturb.items():
            f = np.ones(size)
            f[worst] = rng.choice(np.asarray(choices), size=n)
            factors[name] = f
        return sources, factors

    def _note(self, record: dict[str, Any], sources: np.ndarray, new: TrainState):
        hp = {k: np.asarray(new.hyperparams[k]).tolist() for k in self.perturb}
        decision = {"step": record["step"], "sources": sources.tolist(), **hp}
        self.decisions.append(decision)
        metrics = record["metrics"]
        metrics["pbt/replaced"] = float(np.sum(sources != np.arange(len(sources))))
        for i, src in enumerate(sources):
            metrics[member_key("pbt/source", i)] = float(src)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen, "decisions": self.decisions}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._seen = int(saved["seen"])
        self.decisions = list(saved["decisions"])


def _exploit(state: TrainState, sources: np.ndarray) -> TrainState:
    """Every member-axis array of ``state`` gathered by ``sources`` (the step
    and the root keys kept)."""
    index = jnp.asarray(sources)
    fields = {}
    for field in dataclasses.fields(state):
        if field.name in _KEEP or field.name == "optimizer_def":
            continue
        value = getattr(state, field.name)
        fields[field.name] = jax.tree.map(lambda x: _take(x, index), value)
    return state.replace(**fields)


def _take(x: Any, index: jax.Array) -> Any:
    """Member ``index[i]``'s slice of ``x`` as member ``i``'s; an array held
    once for every member (a member axis of 1: `pztrain.stack_members`'s
    ``shared``) is every member's already, and is kept."""
    if not isinstance(x, jax.Array) or (x.shape[0] == 1 < index.shape[0]):
        return x
    return jnp.take(x, index, axis=0)


def _explore(state: TrainState, sources: np.ndarray, factors: dict) -> TrainState:
    if not factors:
        return state
    values = {
        name: np.asarray(state.hyperparams[name]) * f for name, f in factors.items()
    }
    return set_member_hyperparams(state, **values)
