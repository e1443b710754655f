"""The deadline rule and the one path of all work (dispatcher.py); one invocation's
work from admission to settlement (work.py); running user code and the one error
boundary (calls.py, threads.py), eager starts (eager.py), batches (batcher.py), one
timer for all deadlines (deadlines.py) and one for run limits (overruns.py).

May import runtime.jobs, runtime.models and below.
"""
