"""`TrainState`: the immutable pytree that holds a training run.

* `pztrain.state._state`: the class (fields, builders, views, updates);
* `pztrain.state._donation`: what a consumed (donated) state raises;
* `pztrain.state._flax`: Flax's habits (``replace(apply_fn=...)``, serialization);
* `pztrain.state._treescope`: treescope's text view unfolded by width.
"""

from pztrain.state._donation import DonatedStateError
from pztrain.state._state import TrainState

__all__ = ["DonatedStateError", "TrainState"]
