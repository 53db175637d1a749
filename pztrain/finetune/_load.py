"""Weights in: a Hugging Face checkpoint read into a model of any family
through a `WeightMapping`, each process reading only the boxes its devices
hold, and the `ImportReport` of what came from where."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain import partition
from pztrain._table import text_table
from pztrain._tree import is_array_like, is_float_array, named_leaves
from pztrain.finetune._hf import checkpoint_files
from pztrain.finetune._mapping import Entry, MappingError, WeightMapping, plan_import
from pztrain.finetune._place import box_of, device_layout, place
from pztrain.finetune._transforms import read_plan, to_target

__all__ = ["ImportReport", "load_pretrained", "model_params", "penzai_skeleton"]


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """What `load_pretrained` read: ``print(report)`` shows it as a table.

    Attributes:
      where: The checkpoint read.
      loaded: Each loaded param name → the stored tensor it came from.
      missing: The model's params no tensor filled (kept as they were).
      unexpected: The stored tensors no rule matched (not read).
      bytes_read: Bytes of tensor data this process read.

    Example:
      >>> import tempfile, numpy as np, jax.numpy as jnp, safetensors.numpy
      >>> from pztrain.finetune import Rule, WeightMapping, load_pretrained
      >>> mapping = WeightMapping([Rule("fc.{p}", "fc/{p}")])
      >>> with tempfile.TemporaryDirectory() as d:
      ...     tensors = {"fc.weight": np.ones((3, 2), np.float32)}
      ...     safetensors.numpy.save_file(tensors, d + "/model.safetensors")
      ...     like = {"fc": {"weight": jnp.zeros((3, 2)), "bias": jnp.zeros(3)}}
      ...     params, report = load_pretrained(d, like, mapping, partial=True)
      ...
      >>> report.loaded, report.missing, report.bytes_read
      ({'fc/weight': 'fc.weight'}, ('fc/bias',), 24)
    """

    where: str
    loaded: dict[str, str]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    bytes_read: int

    def __str__(self) -> str:
        rows = [("loaded", t, s) for t, s in self.loaded.items()]
        rows += [("missing", t, "-") for t in self.missing]
        rows += [("unexpected", "-", s) for s in self.unexpected]
        table = text_table(("", "param", "stored"), rows, "param")
        return (
            f"From {self.where}: {len(self.loaded)} loaded, {len(self.missing)} "
            f"missing, {len(self.unexpected)} unexpected, {self.bytes_read:,} "
            f"bytes read.\n{table}"
        )


def model_params(like: Any) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]:
    """The named float arrays of ``like`` (a params dict, or a model of any
    family, concrete or abstract, frozen penzai params included) and a function
    that puts new ones back."""
    if isinstance(like, Mapping) and all(
        is_array_like(x) for x in jax.tree.leaves(like)
    ):
        named = dict(named_leaves(like))
        treedef = jax.tree.structure(like)
        return named, lambda p: treedef.unflatten([p[n] for n in named])
    fast = _frozen_penzai_params(like)
    if fast is not None:
        return fast
    params, rest = partition.split(like, frozen=True)
    return params, lambda p: partition.to_user_model(partition.merge(p, rest))


def _frozen_penzai_params(like: Any) -> tuple[dict[str, Any], Callable] | None:
    """`model_params` of a penzai v2 model whose variables are all frozen (a
    skeleton, a frozen model) in one flatten and one unflatten, the same names
    and model as `pztrain.partition.split` then ``to_user_model`` give (those
    take several passes over the tree: most of a small import's fixed cost);
    ``None`` for any other model, or a parameter holding several arrays."""
    pz_vars = _penzai_variables()
    if pz_vars is None:
        return None
    kinds = pz_vars.AbstractVariableValue | pz_vars.AbstractVariable
    is_var = lambda x: isinstance(x, kinds)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(like, is_leaf=is_var)
    values = [x for x in leaves if is_var(x)]
    if not values or any(isinstance(x, pz_vars.AbstractVariable) for x in values):
        return None
    named, value_defs, slots = {}, {}, [x.get_slot() for x in values]
    for x in values:
        if isinstance(x, pz_vars.ParameterValue) and x.metadata.get("trainable", True):
            arrays, value_def = jax.tree.flatten(x.value)
            label = str(x.label)
            if len(arrays) != 1 or named.get(label, arrays[0]) is not arrays[0]:
                return None  # split names several arrays, or refuses a conflict
            if is_float_array(arrays[0]):
                named[label], value_defs[label] = arrays[0], value_def
    where = [i for i, x in enumerate(leaves) if is_var(x)]

    def rebuild(new: dict[str, Any]) -> Any:
        made: dict[Any, Any] = {}  # one variable per slot: shared ones stay shared
        for x, slot in zip(values, slots, strict=True):
            if slot in made:
                continue
            label = str(x.label) if isinstance(x, pz_vars.ParameterValue) else None
            if label in value_defs:  # the unfrozen copy with its new value
                value = value_defs[label].unflatten([new[label]])
                x = pz_vars.Parameter(value=value, label=x.label, metadata=x.metadata)
                made[slot] = x
            else:
                made[slot] = x.unfreeze_as_copy()
        out = list(leaves)
        for i, slot in zip(where, slots, strict=True):
            out[i] = made[slot]
        return treedef.unflatten(out)

    return named, rebuild


def _penzai_variables() -> Any:
    try:
        from penzai.core import variables
    except ImportError:  # penzai is not installed: no penzai model either
        return None
    return variables


def load_pretrained(
    path: str | os.PathLike,
    like: Any,
    mapping: WeightMapping,
    *,
    dtype: Any = None,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    partial: bool = False,
) -> tuple[Any, ImportReport]:
    """Reads a checkpoint in Hugging Face's layout into a model like ``like``.

    Every name, shape and dtype is checked against ``mapping`` before any tensor
    is read. Each process reads (sliced reads, ``pztrain[safetensors]``) only the
    box of each tensor its devices hold, once, and copies it once onto them.

    Args:
      path: A directory holding ``model.safetensors`` or shards and
        ``model.safetensors.index.json``; or one of those files.
      like: The model to fill (penzai v2 or v1, equinox, Flax NNX, a dict of
        arrays), concrete or abstract: its float arrays, frozen ones included.
      mapping: The architecture's `WeightMapping`.
      dtype: The floating dtype to load as (``jnp.bfloat16`` for a frozen
        base); ``None``: each target's own.
      shardings: Param name → sharding (default: the sharding of ``like``'s
        array, else the default device).
      partial: Allow params no tensor fills (kept as ``like`` has them) and
        tensors no rule matches (reported, not read).

    Returns:
      ``(model, report)``: ``like`` with the loaded arrays, an `ImportReport`.

    Raises:
      MappingError: a rule matching nothing, two tensors onto one param, a
        shape no transform fits (both shapes named), a float into an integer;
        without ``partial``, params unfilled or tensors unread (listed).
      FileNotFoundError: no checkpoint, or a shard the index names is missing.

    Example:
      >>> import tempfile, numpy as np, jax.numpy as jnp, safetensors.numpy
      >>> from pztrain.finetune import Rule, Transpose, WeightMapping, load_pretrained
      >>> mapping = WeightMapping([Rule("fc.weight", "w", (Transpose((1, 0)),))])
      >>> w = np.arange(6, dtype=np.float32).reshape(3, 2)
      >>> with tempfile.TemporaryDirectory() as d:
      ...     safetensors.numpy.save_file({"fc.weight": w}, d + "/model.safetensors")
      ...     params, _ = load_pretrained(d, {"w": jnp.zeros((2, 3))}, mapping,
      ...                                 dtype=jnp.bfloat16)
      ...
      >>> params["w"]
      Array([[0, 2, 4],
             [1, 3, 5]], dtype=bfloat16)
    """
    with checkpoint_files(path) as files:
        targets, rebuild = model_params(like)
        want, entries, *rest = _plan(files, mapping, targets, dtype, partial)
        loaded = _read_all(files, entries, targets, want, shardings or {})
    sources = {e.target: e.source for e in entries}
    report = ImportReport(str(files.where), sources, *rest, files.bytes_read)
    return rebuild({**targets, **loaded}), report


def _plan(files: Any, mapping: WeightMapping, targets, dtype, partial) -> tuple:
    """Each param's shape and dtype to load, and the checked pairs."""
    where = str(files.where)
    want = {n: (tuple(np.shape(x)), _dtype(x, dtype)) for n, x in targets.items()}
    entries, missing, unexpected = plan_import(mapping, files.header, want, where)
    if (missing or unexpected) and not partial:
        raise MappingError(
            f"{mapping.name} mapping and {where} do not match: params no tensor "
            f"fills {list(missing)[:8]}, tensors no rule reads "
            f"{list(unexpected)[:8]}. Add rules, or pass partial=True to load what "
            "matches (the report lists the rest)."
        )
    return want, entries, missing, unexpected


def _dtype(x: Any, dtype: Any) -> np.dtype:
    own = np.dtype(x.dtype)
    if dtype is not None and jnp.issubdtype(own, jnp.inexact):
        return np.dtype(dtype)
    return own


def _shardings(entries: list[Entry], targets: Any, given: Mapping) -> dict:
    """Each loaded param's sharding: given, else its array's, else ``None``
    (the default device, uncommitted, as any new array: a state mixing
    committed and uncommitted arrays compiles its step twice, the first call's
    outputs being committed)."""
    out = {}
    for e in entries:
        own = getattr(targets[e.target], "sharding", None)
        if not isinstance(own, jax.sharding.Sharding):
            own = None
        out[e.target] = given.get(e.target) or own
    return out


def _read_all(files, entries, targets, want, shardings) -> dict[str, jax.Array]:
    where = _shardings(entries, targets, shardings)
    return {e.target: _read(files, e, want[e.target][1], where) for e in entries}


def _read(files: Any, e: Entry, dtype: np.dtype, where: Mapping) -> jax.Array:
    """One param: the box its addressable devices hold, read once, on them."""
    shape, sharding = e.shapes[-1], where[e.target]
    whole = tuple((0, n) for n in shape)
    box = whole if sharding is None else box_of(sharding, shape)
    boxes, got = read_plan(e.transforms, e.shapes, box)
    region = to_target(e.transforms, files.read(e.source, boxes[0]), boxes)
    if sharding is None:  # the default device, uncommitted
        return jax.device_put(device_layout(region, dtype))
    return place(region, got, shape, sharding, dtype)


def penzai_skeleton(build: Callable[[Any], Any]) -> Any:
    """The penzai v2 model ``build(init_base_rng)`` makes, its parameters frozen
    and abstract (``jax.ShapeDtypeStruct``): a target for `load_pretrained`
    that computes no weight. Its other arrays (constants) are concrete, which a
    ``jax.eval_shape`` of the whole model would not give.

    Example:
      >>> import jax; from penzai import pz
      >>> from pztrain.finetune import penzai_skeleton
      >>> model = penzai_skeleton(lambda rng: pz.nn.Linear.from_config(
      ...     name="l", init_base_rng=rng, input_axes={"i": 2},
      ...     output_axes={"o": 3}))
      ...
      >>> model.weights.value.data_array
      ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """
    from penzai import pz

    values = jax.eval_shape(
        lambda: pz.unbind_params(build(jax.random.key(0)), freeze=True)[1]
    )
    return pz.bind_variables(build(None), values)
