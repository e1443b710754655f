"""The deadline rule and the one path of all work (dispatcher.py); one invocation's
work from admission to settlement (work.py); the schedulers, which decide what
runs when (the dispatcher's direct path, batches: batcher.py, decode steps:
decode.py); the one executor of user code, its error boundary and its run-limit
watch (executor.py, threads.py, one timer for all run limits: overruns.py),
eager starts (eager.py), one timer for all deadlines (deadlines.py).

May import runtime.jobs, runtime.models and below.
"""
