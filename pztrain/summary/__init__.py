"""The state at a glance: `summarize` (``state.summary()``) and treescope's view.

`summarize` lists every array of the model, one row each (name, shape, dtype,
count, bytes, trainable / frozen / state / constant / buffer with a Flax NNX variable's
type, and the sharding when a state is placed on a mesh), then the totals of
each part of the state, the step and the key. Typed PRNG key arrays show as
``key<fry>`` with the bytes of their key data. The result, a `Summary`, is a
``str`` (``print(state.summary())``) that a notebook shows as an HTML table.
Treescope's own view of a state (``treescope.render_to_text(state)``) unfolds by width.

* `pztrain.summary._rows`: the rows, one `ParamRow` per array;
* `pztrain.summary._totals`: the totals per part of the state;
* `pztrain.summary._summary`: `Summary` and `summarize`.
"""

from pztrain.summary._rows import ParamRow
from pztrain.summary._summary import Summary, summarize
from pztrain.summary._totals import optimizer_state_types

__all__ = [
    "ParamRow",
    "Summary",
    "optimizer_state_types",
    "summarize",
]
