"""E2B's protocol as a front end of Pal (docs/e2b.md, issue 40).

Its REST API (mounted under ``/e2b``) and the in-sandbox agent API (Connect-RPC services,
``/files``, the code interpreter) on the agent listener, translated onto the operations of
``ops.py``. This package owns no lifecycle logic and no state of its own.
"""
