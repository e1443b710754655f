"""Models in instance memory: the lifecycle state machine, the cache (entries,
admission, leases), single-flight loading, eviction, estimates, and weights
(the only home of torch and safetensors).

May import runtime.bundles, runtime.registry, runtime.context and below; never runtime.jobs.
"""
