"""Optional integrations with other tools, one module each.

Each imports its tool only when used, and says which extra to install if it is
missing: `pztrain.integrations.optuna` (``pip install 'pztrain[optuna]'``), and
`pztrain.integrations.optuna_population` (Optuna trials trained as one
population).
"""

__all__: list[str] = []
