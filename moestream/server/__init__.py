"""The OpenAI-compatible server: `moestream serve`, or `create_app(...)` for an ASGI app (see app.py)."""
