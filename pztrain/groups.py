"""Parameter groups chosen by name: the labels ``optax.partition`` expects.

Every parameter of a `pztrain.TrainState` has a name (``"layers/0/weight"``, a
penzai label such as ``"mlp/Affine_0/Linear.weights"``, an NNX path). A group is
chosen by rules on those names: ``(pattern, label)`` pairs, where a pattern is a
regex searched in the name or a predicate ``(name, value) -> bool``; the first
rule that matches gives the label, else ``default``.

* `labels` — the label tree for a state, a model or a params pytree, to look at
  or to give ``optax.partition`` / ``optax.multi_transform``.
* `by_name` — the same rules as a function of the params, which optax calls at
  ``init`` and ``update`` (so the optimizer is written before the state exists).
* `group_optimizer` — ``optax.partition`` with the checks: every label has a
  transformation, every parameter a label; a rule that matches nothing warns.
* `frozen` — a group that never moves (``optax.set_to_zero()``): no optimizer
  state arrays for it.
* `weight_decay_mask` — the usual mask for ``optax.adamw``: no decay on biases,
  norms and other 0-/1-D arrays.

A learning rate per group: give each group its own
``optax.inject_hyperparams(...)``; `pztrain.TrainState.hyperparams` then reads
``"<label>/learning_rate"`` and ``with_hyperparams`` sets it, with no recompile.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from pztrain import partition
from pztrain._tree import is_array, named_leaves, path_name

__all__ = [
    "GroupError",
    "Rules",
    "by_name",
    "frozen",
    "group_optimizer",
    "labels",
    "weight_decay_mask",
]

Pattern = str | Callable[[str, Any], bool]
Rules = Sequence[tuple[Pattern, str]] | Mapping[Pattern, str]

# Names of biases and normalisation parameters, for `weight_decay_mask`.
NO_DECAY = r"(?i)(bias|norm|(^|[/.])(b|beta|gamma|scale|offset)$)"


class GroupError(ValueError):
    """A parameter group rule that cannot be applied: names the label or param.

    Example:
      >>> from pztrain.groups import group_optimizer, GroupError
      >>> import jax.numpy as jnp, optax
      >>> tx = group_optimizer({"embed": optax.sgd(0.1)}, [(r"^embed", "embed")])
      >>> try:
      ...     tx.init({"embed": jnp.ones(2), "w": jnp.ones(2)})
      ... except GroupError as e:
      ...     print(e)  # doctest: +ELLIPSIS
      Parameter 'w' matches no rule and there is no default label: ...
    """


class _Rule:
    def __init__(self, pattern: Pattern, label: Any):
        self.label = label
        self.shown = pattern if isinstance(pattern, str) else _callable_name(pattern)
        if isinstance(pattern, str):
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise GroupError(
                    f"The rule {pattern!r} (label {label!r}) is not a valid regular "
                    f"expression: {e}."
                ) from None
            self.matches = lambda name, value: compiled.search(name) is not None
        elif callable(pattern):
            self.matches = pattern
        else:
            raise GroupError(
                f"A rule's pattern must be a regex string or a predicate "
                f"(name, value) -> bool; got {type(pattern).__name__} for label "
                f"{label!r}."
            )


def _callable_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _rules(rules: Rules) -> list[_Rule]:
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise GroupError(
                "rules must be (pattern, label) pairs or a dict pattern -> label; "
                f"got {pair!r}."
            )
        out.append(_Rule(*pair))
    return out


def _label_tree(
    params: Any, rules: list[_Rule], default: Any, *, warn: bool = True
) -> Any:
    """The label of every leaf of ``params`` (same structure)."""
    used = [False] * len(rules)

    def label_of(path: Any, value: Any) -> Any:
        name = path_name(path)
        for i, rule in enumerate(rules):
            if rule.matches(name, value):
                used[i] = True
                return rule.label
        if default is None:
            raise GroupError(
                f"Parameter {name!r} matches no rule and there is no default "
                "label: add a rule for it or give default=<label>."
            )
        return default

    tree = jax.tree_util.tree_map_with_path(label_of, params)
    if warn:
        for rule, was_used in zip(rules, used, strict=True):
            if not was_used:
                names = [n for n, _ in named_leaves(params)]
                warnings.warn(
                    f"The parameter group rule {rule.shown!r} (label "
                    f"{rule.label!r}) matches no parameter; names are e.g. "
                    f"{names[:4]}.",
                    stacklevel=4,
                )
    return tree


def _params_of(target: Any) -> Any:
    """The params an optimizer sees: a state's, a params pytree, or a model's."""
    if hasattr(target, "params") and hasattr(target, "opt_state"):
        return target.params
    if isinstance(target, dict | list | tuple) and all(
        is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
        for x in jax.tree.leaves(target)
    ):
        return target
    return partition.split(target)[0]


def labels(target: Any, rules: Rules, *, default: Any = "default") -> Any:
    """The label of every parameter, as the tree ``optax.partition`` expects.

    Args:
      target: A `pztrain.TrainState` (its ``params``), a params pytree (a dict
        or list of arrays, kept as is) or a model of any family (split as
        `pztrain.TrainState.initial_state` does: a flat dict by name).
      rules: ``(pattern, label)`` pairs, or a dict pattern → label, in order: a
        regex searched in the name, or a predicate ``(name, value) -> bool``.
        The first match wins.
      default: The label of a parameter no rule matches; ``None`` makes that an
        error.

    Returns:
      A pytree of labels with the structure of the params.

    Raises:
      GroupError: a bad pattern, or a parameter with no label and no default.

    Warns:
      UserWarning: naming a rule that matches no parameter.

    Example:
      >>> import jax.numpy as jnp; from pztrain.groups import labels
      >>> params = {"embed": jnp.ones((4, 2)), "dense/w": jnp.ones((2, 2)),
      ...           "dense/bias": jnp.zeros(2)}
      >>> labels(params, [(r"^embed", "embed"), (r"bias$", "no_decay")])
      {'dense/bias': 'no_decay', 'dense/w': 'default', 'embed': 'embed'}
    """
    return _label_tree(_params_of(target), _rules(rules), default)


def by_name(rules: Rules, *, default: Any = "default") -> Callable[[Any], Any]:
    """The rules of `labels` as a function ``params -> labels`` for optax.

    ``optax.partition`` / ``multi_transform`` and ``optax.masked`` call it with
    the params at ``init`` and the updates at ``update``, so the optimizer can be
    written before the state exists. The rules are checked at once.

    Example:
      >>> import jax, jax.numpy as jnp, optax; from pztrain.groups import by_name
      >>> tx = optax.partition(
      ...     {"fast": optax.sgd(1.0), "slow": optax.sgd(0.5)},
      ...     by_name([(r"bias", "fast")], default="slow"))
      >>> params = {"w": jnp.ones(2), "bias": jnp.ones(2)}
      >>> updates, _ = tx.update(params, tx.init(params))
      >>> jax.tree.map(float, {k: v[0] for k, v in updates.items()})
      {'bias': -1.0, 'w': -0.5}
    """
    checked = _rules(rules)

    def label_fn(params: Any) -> Any:
        return _label_tree(params, checked, default)

    return label_fn


def group_optimizer(
    transforms: Mapping[Any, optax.GradientTransformation],
    rules: Rules,
    *,
    default: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """One optax transformation per group of parameters chosen by name.

    ``optax.partition(transforms, by_name(rules, default=default))``, checked at
    ``init``: a label without a transformation, or a parameter without a label,
    is an error that names it. Each group's optimizer state holds arrays for its
    own parameters only.

    Args:
      transforms: Label → optax transformation.
      rules: As for `labels`.
      default: The label of parameters no rule matches; ``None`` (the default)
        requires every parameter to match a rule.

    Raises:
      GroupError: naming a label no transformation is given for (with the
        parameters it labels), or a parameter with no label.

    Example:
      >>> from pztrain.groups import group_optimizer
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = group_optimizer(
      ...     {"embed": optax.adam(1e-4), "rest": optax.adam(1e-3)},
      ...     [(r"^embed", "embed")], default="rest")
      >>> state = tx.init({"embed": jnp.ones((4, 2)), "w": jnp.ones((2, 2))})
      >>> sorted(state.inner_states)
      ['embed', 'rest']
    """
    transforms = dict(transforms)
    if default is not None and default not in transforms:
        raise GroupError(
            f"The default label {default!r} has no transformation; the "
            f"transformations are for {sorted(map(str, transforms))}."
        )
    label_fn = by_name(rules, default=default)
    inner = optax.partition(transforms, label_fn)

    def init_fn(params: Any) -> Any:
        _check_covered(label_fn(params), transforms)
        return inner.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, inner.update)


def _check_covered(label_tree: Any, transforms: Mapping[Any, Any]) -> None:
    missing: dict[Any, list[str]] = {}
    for name, label in named_leaves(label_tree):
        if label not in transforms:
            missing.setdefault(label, []).append(name)
    if missing:
        label, names = next(iter(missing.items()))
        raise GroupError(
            f"The label {label!r} has no transformation (it labels {names[:4]}); "
            f"the transformations are for {sorted(map(str, transforms))}."
        )


def frozen(
    optimizer: optax.GradientTransformation, rules: Sequence[Pattern] | Pattern
) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` for every parameter but those matching ``rules``, which
    never change (``optax.set_to_zero()``) and hold no optimizer state arrays.

    Args:
      optimizer: The transformation of the trained parameters.
      rules: A regex or predicate, or a list of them: the frozen parameters.

    Example:
      >>> import jax.numpy as jnp, optax; from pztrain.groups import frozen
      >>> tx = frozen(optax.adam(1e-3), r"^embed")
      >>> params = {"embed": jnp.ones((4, 2)), "w": jnp.ones((2, 2))}
      >>> import jax
      >>> [p for p, _ in jax.tree_util.tree_flatten_with_path(tx.init(params))[0]
      ...  if "embed" in jax.tree_util.keystr(p)]
      []
    """
    patterns = [rules] if isinstance(rules, str) or callable(rules) else list(rules)
    return group_optimizer(
        {"trained": optimizer, "frozen": optax.set_to_zero()},
        [(p, "frozen") for p in patterns],
        default="trained",
    )


def weight_decay_mask(exclude: Pattern = NO_DECAY) -> Callable[[Any], Any]:
    """A mask for ``optax.adamw(..., mask=...)``: decay all but biases and norms.

    A parameter is excluded (``False``) if its name matches ``exclude`` (by
    default biases, norms and their ``scale`` / ``gamma`` / ``beta``) or it has
    fewer than two dimensions.

    Example:
      >>> import jax.numpy as jnp; from pztrain.groups import weight_decay_mask
      >>> mask = weight_decay_mask()
      >>> mask({"mlp/Linear.weights": jnp.ones((2, 2)),
      ...       "mlp/AddBias.bias": jnp.ones(2),
      ...       "LayerNorm/scale": jnp.ones(2)})
      {'LayerNorm/scale': False, 'mlp/AddBias.bias': False, 'mlp/Linear.weights': True}
    """
    rule = _Rule(exclude, False)

    def decays(path: Any, value: Any) -> bool:
        if rule.matches(path_name(path), value):
            return False
        return len(getattr(value, "shape", ())) >= 2

    def mask(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(decays, params)

    return mask
