"""The small grain dataset the data tests share: 40 examples, each made from
its index (features, a label, and the index itself to follow the order)."""

from __future__ import annotations

import grain
import numpy as np

N = 40


def example(i) -> dict[str, np.ndarray]:
    """Example ``i``: features from its index, and the index itself."""
    i = int(i) % N
    x = np.random.default_rng(i).standard_normal(4).astype(np.float32)
    return {"x": x, "y": np.float32(x.sum() > 0), "id": np.int32(i)}


def examples() -> grain.MapDataset:
    return grain.MapDataset.range(N).map(example)
