"""The deadline rule and the one path of all work (dispatcher.py); one invocation's
work from admission to settlement (work.py); the schedulers, which decide what
runs when (the dispatcher's direct path, batches: batcher.py, decode steps:
decode.py); the one executor of user code and its error boundary (executor.py,
threads.py), eager starts (eager.py), one timer for all deadlines (deadlines.py)
and one for run limits (overruns.py).

May import runtime.jobs, runtime.models and below.
"""
