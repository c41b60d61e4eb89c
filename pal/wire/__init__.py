"""The contract between the control plane and its nodes: the node RPC's verbs, declared
once each (verbs.py), the models they carry, and how they travel (http.py, tunnel.py,
auth.py). The only package both the node agent (pal/manager) and the control plane
(pal/scheduler, pal/api) import; it imports neither (docs/internals.md)."""
