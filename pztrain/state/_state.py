"""`TrainState`: the immutable pytree that holds a training run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from penzai import pz

from pztrain import partition
from pztrain._members import member_count
from pztrain._optax import (
    check_optimizer,
    injected_hyperparams,
    optimizer_update,
    set_hyperparams,
)
from pztrain.ema import ema_params_of
from pztrain.state import _flax
from pztrain.state._donation import DonatedStateError, check_alive
from pztrain.state._parts import (
    check_grads,
    check_key,
    check_opt_state,
    owned_copy,
    placed_like,
)
from pztrain.state._struct import field_names, register, replaced
from pztrain.state._treescope import readable_treescope, short_functions
from pztrain.summary import Summary, summarize

__all__ = ["TrainState", "DonatedStateError", "check_state"]


class TrainState(pz.Struct):
    """Everything a training run carries, as one immutable pytree.

    The trainable arrays and the rest of the model are kept apart, so the train
    step moves only arrays across ``jax.jit`` and checkpoints can hold the params
    alone. ``state.model`` merges them back when a full model is wanted.

    Subclass it to carry more fields (``epoch``, ``batch_stats``, ``metrics``, …):
    write the subclass plainly, without a decorator; it becomes a frozen
    dataclass and a pytree. The train step and `apply_gradients` carry extra
    fields through unchanged; `replace` updates them.

    Attributes:
      step: The number of optimizer steps taken, an int32 JAX scalar (never a
        Python int, which would force a retrace per value).
      root_rng: The base PRNG key; step ``s`` uses
        ``jax.random.fold_in(root_rng, s)``.
      params: The trainable arrays: a flat ``dict`` name → array for models given
        to `initial_state` (names: see `pztrain.partition`), or the params pytree
        given to `create`.
      model_without_params: The model with a `pztrain.partition.ParamSlot` at each
        trainable array; frozen arrays and penzai v2 state variables live here.
      opt_state: The optax state of the trainable params.
      loss_fn_state: State threaded through the loss function (``None`` if
        unused).
      optimizer_def: The optax transformation (static).

    Example:
      >>> import jax, jax.numpy as jnp, optax; from pztrain import TrainState
      >>> model = {"w": jnp.zeros(3), "b": jnp.zeros(())}
      >>> state = TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
      >>> sorted(state.params)
      ['b', 'w']
      >>> state = state.apply_gradients({"w": jnp.ones(3), "b": jnp.ones(())})
      >>> int(state.step), state.model["w"]
      (1, Array([-0.1, -0.1, -0.1], dtype=float32))
    """

    step: jax.Array
    root_rng: jax.Array
    params: Any
    model_without_params: Any
    opt_state: Any
    loss_fn_state: Any
    optimizer_def: optax.GradientTransformation = dataclasses.field(
        metadata={"pytree_node": False}
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(cls)

    # ------------------------------------------------------------------ build

    @classmethod
    def initial_state(
        cls,
        model: Any,
        optimizer_def: optax.GradientTransformation,
        root_rng: jax.Array,
        loss_fn_state: Any = None,
        *,
        trainable: partition.Trainable = None,
        **extra_fields: Any,
    ) -> TrainState:
        """Builds the state at step 0 from a model.

        The model is split once (see `pztrain.partition.split`); the optimizer is
        initialised on the trainable params only. The state holds copies of the
        model's arrays, so a train step that donates them leaves ``model`` intact.

        Args:
          model: A penzai v2 or v1 model, an equinox module, or any pytree.
          optimizer_def: An optax transformation.
          root_rng: ``jax.random.key(seed)`` or the legacy
            ``jax.random.PRNGKey(seed)``.
          loss_fn_state: Initial state for the loss function, if any.
          trainable: Which arrays to train: ``None`` (all float arrays), a regex
            searched in parameter names, or a predicate ``(name, value) -> bool``.
          **extra_fields: Values for the fields a subclass adds.

        Returns:
          The initial state.

        Raises:
          TypeError: if ``optimizer_def`` is not an optax transformation or
            ``root_rng`` is not a key.
          pztrain.partition.PartitionError: if the model cannot be split.
        """
        check_optimizer(optimizer_def)
        check_key(root_rng)
        params, rest = partition.split(model, trainable)
        return cls._from_parts(
            params, rest, optimizer_def, root_rng, loss_fn_state, extra_fields
        )

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        root_rng: jax.Array | None = None,
        loss_fn_state: Any = None,
        **extra_fields: Any,
    ) -> TrainState:
        """Flax-style constructor: ``apply_fn`` + params + ``tx``.

        Code written for Flax's ``TrainState`` (``state.apply_fn({"params": p},
        x)``, ``state.apply_gradients(grads=g)``, ``state.tx``) runs unchanged.
        ``state.model`` is an `pztrain.partition.ApplyFnModel`, so penzai-style
        loss functions (``model(x)``) work with `pztrain.build_train_step` too.

        Args:
          apply_fn: The model's apply function, e.g. ``module.apply``.
          params: The parameter pytree (Flax's ``variables["params"]``).
          tx: An optax transformation.
          root_rng: Base PRNG key; ``jax.random.key(0)`` when omitted.
          loss_fn_state: Initial loss-function state, if any.
          **extra_fields: Values for the fields a subclass adds.

        Returns:
          The state at step 0.

        Example:
          >>> import jax.numpy as jnp, optax; from pztrain import TrainState
          >>> state = TrainState.create(
          ...     apply_fn=lambda v, x: v["params"]["w"] * x,
          ...     params={"w": jnp.array(1.0)}, tx=optax.sgd(0.5))
          >>> state.apply_fn({"params": state.params}, 2.0)
          Array(2., dtype=float32, weak_type=True)
        """
        check_optimizer(tx)
        root_rng = jax.random.key(0) if root_rng is None else check_key(root_rng)
        rest = partition.ApplyFnModel(apply_fn, None)
        return cls._from_parts(params, rest, tx, root_rng, loss_fn_state, extra_fields)

    @classmethod
    def _from_parts(cls, params, rest, optimizer_def, root_rng, lfs, extra):
        owned: set[int] = set()
        _flax.adopt(cls, params)  # refuses fp8 collections; flax serialization
        params = owned_copy(params, owned, always=True)
        opt_state = owned_copy(optimizer_def.init(params), owned)
        lfs = owned_copy(lfs, owned, always=True)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - fields)
        if unknown:
            raise TypeError(
                f"{cls.__name__} has no field(s) {unknown}; its fields are "
                f"{sorted(fields)}. Subclass TrainState to add fields."
            )
        return cls(
            step=jnp.zeros((), jnp.int32),
            root_rng=root_rng,
            params=params,
            model_without_params=rest,
            opt_state=opt_state,
            loss_fn_state=lfs,
            optimizer_def=optimizer_def,
            **extra,
        )

    # ------------------------------------------------------------------ views

    @property
    def model(self) -> Any:
        """The full model: params merged back into ``model_without_params``.

        The result has the type of the model given to `initial_state`; for
        penzai v2 it holds new ``pz.Parameter`` (and ``pz.StateVariable``)
        objects with the current values.
        """
        self.check_not_donated("state.model")
        return partition.to_user_model(
            partition.merge(self.params, self.model_without_params)
        )

    @property
    def tx(self) -> optax.GradientTransformation:
        """Flax name for `optimizer_def`."""
        return self.optimizer_def

    @property
    def apply_fn(self) -> Callable[..., Any]:
        """The Flax-style apply function of a state built with `create`."""
        rest = self.model_without_params
        if not isinstance(rest, partition.ApplyFnModel):
            raise AttributeError(
                "apply_fn exists only on states built with TrainState.create("
                "apply_fn=..., params=..., tx=...); this state holds a "
                f"{type(rest).__name__} model: call state.model(...) instead."
            )
        return rest.apply_fn

    @property
    def hyperparams(self) -> Mapping[str, Any]:
        """Hyperparameters that ``optax.inject_hyperparams`` put in `opt_state`.

        Found anywhere in the optimizer state (``optax.chain``, ``masked`` …),
        merged into a read-only mapping: set them with `with_hyperparams`. A
        `ValueError` if there are none, or two transformations inject one name.
        """
        return injected_hyperparams(self.opt_state)

    def with_hyperparams(self, **values: Any) -> TrainState:
        """A new state with injected hyperparameters set (``learning_rate=1e-4``).

        Copied into new arrays of the stored dtype, they are used from the next
        update on (donating steps too). Unknown names, a name injected twice or
        following a schedule, and a wrong shape are `ValueError` s.

        The new state owns its arrays: the arrays a train step donates (step,
        params, optimizer and loss-function state) are copied, once, so that
        ``fit`` consuming the new state leaves this one usable. One ``state0``
        can start every trial of a search (``fit(state0.with_hyperparams(
        learning_rate=lr), ...)`` per trial); the copy holds the state's arrays
        a second time until this state is dropped. On a mesh, each array keeps
        its sharding.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from pztrain import TrainState
          >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
          >>> state = TrainState.initial_state({"w": jnp.zeros(2)}, tx,
          ...                                  jax.random.key(0))
          >>> state = state.with_hyperparams(learning_rate=0.5)
          >>> state.hyperparams["learning_rate"]
          Array(0.5, dtype=float32)
          >>> state.apply_gradients({"w": jnp.ones(2)}).params["w"]
          Array([-0.5, -0.5], dtype=float32)
        """
        self.check_not_donated("state.with_hyperparams(...)")
        opt_state = placed_like(set_hyperparams(self.opt_state, values), self.opt_state)
        donated = (self.step, self.params, opt_state, self.loss_fn_state)
        step, params, opt_state, lfs = owned_copy(donated, set(), always=True)
        return self.replace(
            step=step, params=params, opt_state=opt_state, loss_fn_state=lfs
        )

    @property
    def ema_params(self) -> Any:
        """The EMA of the params (see `pztrain.with_ema`), structured as `params`.

        A `pztrain.ema.NoEmaError` (a `ValueError`) if the optimizer keeps none.
        """
        self.check_not_donated("state.ema_params")
        return ema_params_of(self.opt_state)

    def using_ema(self) -> TrainState:
        """This state with the EMA params as its `params`, to evaluate or export.

        Give it to `pztrain.evaluate`, an eval step, `pztrain.save_params`,
        `pztrain.export_safetensors` or ``.model``; keep training the original
        state (this one shares the EMA's arrays between ``params`` and
        ``opt_state``, which a donating step cannot take).

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from pztrain import TrainState
          >>> from pztrain import with_ema
          >>> state = TrainState.initial_state(
          ...     {"w": jnp.zeros(2)}, with_ema(optax.sgd(1.0), 0.75), jax.random.key(0)
          ... )
          >>> state = state.apply_gradients({"w": -jnp.ones(2)})
          >>> state.using_ema().model["w"]
          Array([0.25, 0.25], dtype=float32)
        """
        return self.replace(params=self.ema_params)

    def summary(self) -> Summary:
        """The state at a glance: a row per array, totals per part, step, key.

        A ``str`` (``print(state.summary())``) shown as HTML tables in a
        notebook; see `pztrain.summary.summarize`. Reads the step from the device.
        """
        return summarize(self)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Penzai's view, unfolded by width in text (`readable_treescope`), the
        optimizer's functions by name (`short_functions`)."""
        rendering = super().__treescope_repr__(path, short_functions(subtree_renderer))
        return readable_treescope(rendering, member_count(self.root_rng))

    # --------------------------------------------------------------- updates

    def replace(self, **fields: Any) -> TrainState:
        """Returns a copy with ``fields`` replaced (Flax's ``replace``; its
        ``apply_fn=`` and ``tx=`` too).

        Raises:
          TypeError: naming an unknown field.
          ValueError: if a new ``opt_state`` is not what the optimizer's
            ``init`` makes for the params, naming the fields that differ (a
            new ``optimizer_def`` alone is checked by `apply_gradients` and
            the train step).
        """
        names = field_names(cls := type(self))
        fields = _flax.flax_fields(self.model_without_params, fields)
        if not names.issuperset(fields):
            raise TypeError(
                f"{cls.__name__} has no field(s) {sorted(set(fields) - names)}; its "
                f"fields are {sorted(names)}."
            )
        if "opt_state" in fields:  # a lone tx= is Flax's habit: checked when used
            check_opt_state(
                fields.get("optimizer_def", self.optimizer_def),
                fields.get("opt_state", self.opt_state),
                fields.get("params", self.params),
                member_count(fields.get("root_rng", self.root_rng)),
            )
        return replaced(self, fields)

    def apply_gradients(self, grads: Any, **replacements: Any) -> TrainState:
        """Applies one optimizer update and increments `step`.

        Accepts ``grads`` positionally or as ``grads=`` (Flax). Extra fields are
        carried through unchanged unless given in ``replacements``.

        Args:
          grads: Gradients with the structure of `params`.
          **replacements: Other fields to replace at the same time.

        Returns:
          The updated state.

        Raises:
          ValueError: if ``grads`` does not match `params`, naming the missing
            and unexpected names, or `opt_state` is not a state of the
            optimizer for the params (naming the fields that differ).
        """
        check_grads(grads, self.params)
        check_opt_state(
            self.optimizer_def,
            self.opt_state,
            self.params,
            member_count(self.root_rng),
        )
        params, opt_state = optimizer_update(
            self.optimizer_def, grads, self.opt_state, self.params
        )
        return self.replace(
            step=self.step + 1, params=params, opt_state=opt_state, **replacements
        )

    def check_not_donated(self, where: str = "this state") -> None:
        """Raises `DonatedStateError` if the state's arrays were donated to a step."""
        check_alive((self.step, self.params), where, "the params of this TrainState")


register(TrainState)


def check_state(value: Any, where: str, optimizer: str = "") -> None:
    """Raises a `TypeError` unless ``value`` is a `TrainState`: ``where``
    (``"evaluate(state, ...)"``) takes one, and the error shows the line that
    makes one from a model (with ``optimizer``; none given: for evaluation)."""
    if not isinstance(value, TrainState):
        use = "" if optimizer else " (for evaluation alone: the optimizer is unused)"
        raise TypeError(
            f"{where} takes a pztrain.TrainState, not a {type(value).__name__}. "
            f"Make one from the model{use}: state = pztrain.TrainState."
            f"initial_state(model, {optimizer or 'optax.identity()'}, "
            "jax.random.key(0))"
        )
