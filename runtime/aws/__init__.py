"""Lambda mode: the Runtime API client (lambda_api.py), the loop that serves it
(lambda_loop.py) and Function URL / API Gateway v2 events (events.py).

May import runtime.http (the loop routes events through the HTTP app) and below.
"""
