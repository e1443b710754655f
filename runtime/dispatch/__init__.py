"""The deadline rule (dispatcher.py) and running user code: handler threads
(calls.py), eager starts (eager.py), one timer for all deadlines (deadlines.py).

May import runtime.jobs, runtime.models and below.
"""
