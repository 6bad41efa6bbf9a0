"""`localllm serve`'s HTTP layer: app.py (routes), protocol.py (request checks), replies.py (responses),
run.py (uvicorn, graceful shutdown). The scheduler beneath is localllm/engine.py."""
