"""Experiments: one-off measurements that decided something, kept to measure it again.

They are not registered in bench/run.py and not run in CI: each backs a decision
record (docs/decisions/), not a current figure, and may need a machine or a
second checkout (`--against`) to mean anything. Run one by its path:

    .venv/bin/python bench/experiments/NAME.py --help

| script | what it measures | decision |
|---|---|---|
| gemm_layout.py | a decode step's GEMMs: (out, in) vs (in, out) vs packed bf16 | 0007, 0008 |
| model_steps.py | SmolLM2's steps and prefills, `matmul: auto` vs `plain` | 0007 |
| prefill_contention.py | a prefill beside decode steps: thread vs process | 0006 |
| lone_steps.py | a lone call: decode steps vs the per-request loop | 0006 |
| teams.py | torch's loops with one OpenMP team alive against two | 0003 |
| handler_threads.py | the handler threads' hand-off vs ThreadPoolExecutor | 0004, 0005 |
| gpu_attention.py | decode attention on CUDA with cuDNN's backend on and off | 0010 |
| instructions.py | instructions per warm request or job cycle (callgrind) | 0013, 0014 |
| server_cpu.py | server CPU per warm request, vs the bare app or another checkout | 0013, 0014 |
| invoke_payloads.py | warm invocations with 60 KB-1.5 MB bodies vs the bare app | 0015, 0017 |
| job_payloads.py | RSS and cost of jobs with large payloads | 0018 |
| tenants.py | one tenant at its limits against another's latency | 0019 |
| chaos.py | jobs against a server SIGKILLed and restarted | (test_recovery.py) |
| shutdown.py | signal to exit, against the drain grace | (test_shutdown.py) |
"""
