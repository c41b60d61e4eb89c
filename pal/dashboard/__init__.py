"""The web dashboard under /runtime (server-rendered, htmx; see routes.py)."""
