"""How `TrainState` classes become pytrees, and replacing fields fast.

``pz.pytree_dataclass`` flattens in Python (tens of µs per call on the hot
path); `register` makes each `TrainState` class a frozen dataclass flattened by
JAX's C++ dataclass support instead, and keeps its field names for `replaced`
and `after_step`, which build a new state without keyword checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from penzai.core import struct as pz_struct

__all__ = ["after_step", "field_names", "register", "replaced"]

# Field names of each TrainState class, and whether it has a __post_init__.
_FIELDS: dict[type, tuple[frozenset[str], bool]] = {}


def register(cls: type) -> None:
    """Makes ``cls`` a frozen dataclass and a pytree with JAX's C++ flattening.

    ``pz.pytree_dataclass`` flattens in Python (tens of µs per call on the hot
    path); ``jax.tree_util.register_dataclass`` flattens in C++. The penzai marker
    attribute lets ``pz.Struct``'s metaclass, treescope and ``.select()`` treat the
    class as a normal penzai struct.
    """
    dataclasses.dataclass(frozen=True, repr=False)(cls)
    fields = dataclasses.fields(cls)
    _FIELDS[cls] = (frozenset(f.name for f in fields), hasattr(cls, "__post_init__"))
    jax.tree_util.register_dataclass(
        cls,
        data_fields=[f.name for f in fields if pz_struct.is_pytree_node_field(f)],
        meta_fields=[f.name for f in fields if not pz_struct.is_pytree_node_field(f)],
    )
    setattr(
        cls,
        pz_struct.PYTREE_DATACLASS_INFO_ATTR,
        {
            "has_implicitly_inherited_fields": True,
            "use_mutable_proxy_in_init": False,
            "is_init_proxy": False,
            "generated_init": cls.__init__,
        },
    )


def field_names(cls: type) -> frozenset[str]:
    """The field names of a registered state class."""
    return _FIELDS[cls][0]


def replaced(state: Any, fields: dict[str, Any]) -> Any:
    """``state`` with ``fields`` replaced (names already checked).

    A subclass with ``__post_init__`` goes through ``dataclasses.replace`` so
    that it runs; otherwise the new state's ``__dict__`` is filled directly
    (a frozen dataclass's ``__init__`` costs about a microsecond per call).
    """
    if _FIELDS[type(state)][1]:
        return dataclasses.replace(state, **fields)
    new = object.__new__(type(state))
    new.__dict__.update(state.__dict__)
    new.__dict__.update(fields)
    return new


def after_step(state: Any, step: Any, params: Any, opt_state: Any, lfs: Any) -> Any:
    """``state`` with the four fields a train step changes replaced: step,
    params, optimizer state, loss-function state (``lfs``).

    The same as ``state.replace(step=step, params=params, opt_state=opt_state,
    loss_fn_state=lfs)``, for the per-call path of a train step: it fills the
    new state's fields directly (keyword arguments and their checks cost about a
    microsecond per call on CPU).
    """
    cls = type(state)
    if _FIELDS[cls][1]:  # a subclass with __post_init__: run it
        return state.replace(
            step=step, params=params, opt_state=opt_state, loss_fn_state=lfs
        )
    new = object.__new__(cls)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields["step"], fields["params"] = step, params
    fields["opt_state"], fields["loss_fn_state"] = opt_state, lfs
    return new
