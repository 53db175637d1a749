"""Mixed precision: a dtype policy and a loss-function wrapper that applies it.

A `Policy` names three dtypes, as in DeepMind's jmp: the params' (what the
optimizer updates: the master copy), the compute dtype (what the forward and
backward passes run in) and the output dtype (the loss and metrics).
`mixed_precision` wraps a loss function so that it sees its model and float
batch entries in the compute dtype and returns its loss and aux in the output
dtype. The step is unchanged: it differentiates the wrapped loss with respect to
the params, and autodiff through the cast hands the optimizer gradients in the
params' dtype.

Only real floating-point arrays are cast, by JAX's dtype rules (``bfloat16`` and
the float8 types count as floats); integers, complex arrays, keys and non-array
leaves are left alone. Penzai v2 ``StateVariable`` s in the model are not cast
by the wrapper (their updates must reach the step): after the loss function
ran, each gets its old dtype back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from penzai.core import variables as pz_vars

from pztrain._tree import is_array
from pztrain.partition import nnx_variables

__all__ = ["Policy", "mixed_precision"]

_ALIASES = {
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "full": "float32",
    "single": "float32",
    "f64": "float64",
    "double": "float64",
}
_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}


def _float_dtype(value: Any, argument: str) -> jnp.dtype:
    """``value`` as a floating-point ``jnp.dtype``, or a clear error."""
    if isinstance(value, str):
        value = _ALIASES.get(value.strip().lower(), value.strip())
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        names = ", ".join(sorted(_ALIASES))
        raise ValueError(
            f"{argument}={value!r} is not a dtype; use a JAX dtype (jnp.bfloat16) "
            f"or its name ('bfloat16', 'float32', or one of {names})."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{argument} must be a floating-point dtype; got {dtype.name}. "
            "Integer arrays are never cast by a Policy."
        )
    if dtype.itemsize > 4 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"{argument}={dtype.name} needs 64-bit JAX: call "
            "jax.config.update('jax_enable_x64', True) first."
        )
    return dtype


def _is_real_float(x: Any) -> bool:
    """A real floating-point array by JAX's rules (bfloat16 and float8 count)."""
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _cast(tree: Any, dtype: jnp.dtype) -> Any:
    """``tree`` with every real float array cast to ``dtype``; the rest untouched."""

    def cast(x):
        return x.astype(dtype) if _is_real_float(x) and x.dtype != dtype else x

    return jax.tree.map(cast, tree)


def _cast_with_variables(tree: Any, dtype: jnp.dtype) -> Any:
    """`_cast`, also into penzai v2 variables (copied, shared ones stay shared)."""
    unbound, values = pz_vars.unbind_variables(tree, freeze=True)
    if not values:
        return _cast(tree, dtype)
    unbound, values = _cast((unbound, values), dtype)
    return pz_vars.bind_variables(unbound, values, unfreeze_as_copy=True)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype params, computation and outputs use (jmp-style).

    Attributes:
      param_dtype: The params' dtype: what the optimizer updates.
      compute_dtype: The dtype the model runs in.
      output_dtype: The dtype of the loss and aux metrics.

    Example:
      >>> import jax.numpy as jnp; from pztrain.precision import Policy
      >>> policy = Policy.parse("params=float32,compute=bfloat16,output=float32")
      >>> policy == Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      True
      >>> tree = {"w": jnp.ones(2), "ids": jnp.arange(2)}
      >>> cast = policy.cast_to_compute(tree)
      >>> cast["w"].dtype, cast["ids"].dtype
      (dtype(bfloat16), dtype('int32'))
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = _float_dtype(getattr(self, field.name), field.name)
            object.__setattr__(self, field.name, value)

    @classmethod
    def parse(cls, text: str) -> Policy:
        """A policy from ``"params=float32,compute=bfloat16,output=float32"``.

        Keys ``params`` / ``compute`` / ``output`` (or ``p`` / ``c`` / ``o``);
        values are dtype names or the short ``f32``, ``bf16``, ``f16``. A missing
        ``output`` defaults to ``params``.

        Raises:
          ValueError: on an unknown key, a repeated or missing one, or a name
            that is not a floating-point dtype.

        Example:
          >>> from pztrain.precision import Policy
          >>> Policy.parse("p=f32,c=bf16").output_dtype
          dtype('float32')
        """
        given: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            field = _KEYS.get(key.strip().lower())
            if not sep or field is None or field in given:
                raise ValueError(
                    f"Cannot read {item!r} in the policy {text!r}: write each of "
                    "params=, compute=, output= once, e.g. "
                    "'params=float32,compute=bfloat16,output=float32'."
                )
            given[field] = value
        given.setdefault("output_dtype", given.get("param_dtype", ""))
        missing = [f for f in ("param_dtype", "compute_dtype") if f not in given]
        if missing:
            raise ValueError(f"The policy {text!r} has no {' or '.join(missing)}.")
        return cls(**given)

    def cast_to_param(self, tree: Any) -> Any:
        """``tree``'s float arrays in ``param_dtype`` (penzai variables included).

        For a model to train in that dtype: cast it before
        `pztrain.TrainState.initial_state`.
        """
        return _cast_with_variables(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """``tree``'s float arrays in ``compute_dtype`` (penzai variables included)."""
        return _cast_with_variables(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """``tree``'s float arrays in ``output_dtype`` (penzai variables included)."""
        return _cast_with_variables(tree, self.output_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_cotangent(x: jax.Array, factor: float) -> jax.Array:
    """The identity, whose backward pass multiplies the cotangent by ``factor``."""
    return x


def _scale_fwd(x, factor):
    return x, None


def _scale_bwd(factor, _, g):
    return (g * factor,)


_scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def _check_loss_scale(loss_scale: Any) -> float | None:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
        raise TypeError(f"loss_scale must be a number or None; got {loss_scale!r}.")
    if not loss_scale > 0 or loss_scale == float("inf"):
        raise ValueError(
            f"loss_scale must be a finite number > 0; got {loss_scale!r}. Powers "
            "of two (2**10) scale gradients without rounding."
        )
    return float(loss_scale)


def _like(new: Any, old: Any) -> Any:
    """``new`` with each float array in the dtype of ``old``'s (same structure)."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new  # the step reports the mismatch, naming the entry

    def cast(x, y):
        if _is_real_float(x) and _is_real_float(y) and x.dtype != y.dtype:
            return x.astype(y.dtype)
        return x

    return jax.tree.map(cast, new, old)


def _state_variables(model: Any) -> list[Any]:
    is_var = lambda x: isinstance(x, pz_vars.StateVariable)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_var) if is_var(x)]


def mixed_precision(
    loss_fn: Any, policy: Policy | str, *, loss_scale: float | None = None
) -> Any:
    """Wraps a loss function so that it runs under ``policy``.

    The wrapped function has the loss-function contract (see
    `pztrain.step.LossFunction`). It gives ``loss_fn`` the model and the float
    batch entries in ``policy.compute_dtype`` and returns the loss and aux in
    ``policy.output_dtype``; ``new_state`` gets the dtypes of ``state`` back, and
    penzai v2 state variables their old dtypes. A Flax NNX model's
    ``nnx.Param`` s are cast in place (its module stays the one the step reads
    the new state from) and its other variables (batch statistics) keep their
    dtypes. The params stay in their own dtype in the `pztrain.TrainState`
    (cast them once with ``policy.cast_to_param`` to change it); their
    gradients arrive in that dtype.

    With ``loss_scale=S`` the backward pass runs on ``S`` times the gradient
    (float16 gradients then do not underflow) and the gradients are divided by
    ``S`` again where they leave the compute dtype: the optimizer and the logged
    loss see true values, nothing is to be added to the optimizer. A scale that
    overflows gives inf gradients: chain ``optax.apply_if_finite`` to skip
    those steps. bfloat16 has float32's range and needs no scaling.

    Args:
      loss_fn: ``loss_fn(*, model, state, rng, **batch) -> (loss, new_state,
        aux)``.
      policy: A `Policy`, or a string for `Policy.parse`.
      loss_scale: A static loss scale (a power of two), or ``None``.

    Returns:
      The wrapped loss function.

    Raises:
      ValueError: for a policy string or loss scale that cannot be used.

    Example:
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def loss_fn(*, model, state, rng, x, y):
      ...     loss = jnp.mean((x @ model["w"] - y) ** 2)
      ...     return loss, state, {"dtype_ok": loss.dtype == jnp.bfloat16}
      ...
      >>> mp_loss = pztrain.mixed_precision(loss_fn, "params=f32,compute=bf16")
      >>> state = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros((3, 1))}, optax.sgd(0.1), jax.random.key(0))
      >>> step = pztrain.build_train_step(mp_loss)
      >>> state, aux = step(state, x=jnp.ones((4, 3)), y=jnp.ones((4, 1)))
      >>> bool(aux["dtype_ok"]), state.params["w"].dtype
      (True, dtype('float32'))
    """
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy or a string; got {policy!r}.")
    scale = _check_loss_scale(loss_scale)

    @functools.wraps(loss_fn)
    def wrapped(*, model, state, rng, **batch):
        return _run(loss_fn, policy, scale, model, state, rng, batch)

    return wrapped


def _run(loss_fn, policy: Policy, scale: float | None, model, state, rng, batch):
    """One call of a `mixed_precision` loss function."""

    def to_compute(x):
        if not _is_real_float(x):
            return x
        if scale is not None:  # gradients leave the compute dtype divided by S
            x = _scale_cotangent(x, 1.0 / scale)
        return x.astype(policy.compute_dtype)

    variables = _state_variables(model)
    before = [v.value for v in variables]
    nnx_params, nnx_state = nnx_variables(model)
    nnx_before = [v.get_value() for v in nnx_state]
    if nnx_params:  # in place: the step reads the module's new state after
        for param in nnx_params:
            param.set_value(jax.tree.map(to_compute, param.get_value()))
    else:
        model = jax.tree.map(to_compute, model)
    loss, new_state, aux = loss_fn(
        model=model,
        state=state,
        rng=rng,
        **_cast(batch, policy.compute_dtype),
    )
    for variable, value in zip(variables, before, strict=True):
        variable.value = _like(variable.value, value)
    for variable, value in zip(nnx_state, nnx_before, strict=True):
        variable.set_value(_like(variable.get_value(), value))
    loss = _cast(loss, policy.output_dtype)
    if scale is not None:  # the backward pass starts from S
        loss = _scale_cotangent(loss, scale)
    return loss, _like(new_state, state), _cast(aux, policy.output_dtype)
