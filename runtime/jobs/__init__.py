"""Async jobs: the record (job.py), the store contract and its stores (store.py,
stores/), group commit of job creations (group_commit.py), the node's live and
dead owners (owners.py) and this instance's jobs (manager.py, with leases.py:
heartbeats; recovery.py: claims of lapsed and orphaned jobs; store_access.py:
store calls from the loop, and the store's health).

A job is created when a request cannot be answered before its deadline. The
instance that runs it holds a *lease* (owner + lease_until) and renews it with
heartbeats; a job whose lease lapsed (its instance died) is claimed again by
whichever instance next sees it (a poll, or the start-up sweep), up to
`THAW_JOB_MAX_ATTEMPTS`, then failed with `worker-lost`. All state changes are
conditional, so two instances never both own one job. An instance that died on
this node is known dead at once (its owner lock is free), and its jobs are
claimed without waiting for their leases.

May import: runtime.clock, runtime.errors, runtime.telemetry.health, runtime.telemetry.metrics,
runtime.settings.
"""
