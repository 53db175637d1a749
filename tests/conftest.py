"""Strict JAX settings for the test suite."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
