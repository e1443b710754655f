"""What an instance tells the world about itself: Prometheus metrics (metrics.py),
JSON log lines (logs.py) and the conditions readiness is made of (health.py)."""
