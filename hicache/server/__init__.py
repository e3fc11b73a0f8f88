"""Serving: an OpenAI-compatible HTTP API over one `Engine` (FastAPI + uvicorn), with /flush_cache,
/metrics (Prometheus) and /health. `hicache.server.app.create_app` builds the app; `hicache serve`
(`hicache.server.cli`) runs it. Nothing heavy is imported here, so the CLI starts fast."""
