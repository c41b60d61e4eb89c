"""Operator tools beside the server: `pal doctor` (doctor.py)."""
