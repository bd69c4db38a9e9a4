"""Data-parallel gradient reduction: torch DDP's bucket assignment, GradBucket, Reducer,
communication hooks and start-up helpers, for any array kind (docs/data-parallel.md).

One concept per module: ``buckets`` (assignment by size), ``future`` (the hooks' Future),
``kinds`` (flat buffers of the caller's array kind), ``grad_bucket``, ``reducer``,
``hooks`` and ``powersgd`` (the built-in communication hooks), ``helpers``
(broadcast_coalesced, verify_params_across_processes) and ``jit`` (the reduction as a
function on a JAX pytree, usable inside ``jax.jit``).
"""
