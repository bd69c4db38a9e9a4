"""gpucoll collectives inside ``jax.jit``: XLA FFI custom calls handled in Python.

Imported only when a gpucoll.functional call meets a JAX tracer, so ``import gpucoll``
never imports JAX.
"""
