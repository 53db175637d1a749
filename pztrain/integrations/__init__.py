"""Optional integrations with other tools, one module each.

Each imports its tool only when used, and says which extra to install if it is
missing: `pztrain.integrations.optuna` (``pip install 'pztrain[optuna]'``).
"""

__all__: list[str] = []
