"""What goes on the wire: a handler's output as JSON (outputs.py), and an error
as every surface shows it, problem, job, Lambda and CLI (render.py)."""
