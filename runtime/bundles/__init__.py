"""Bundles as data: manifests (manifest.py), where they come from and how their
files reach local disk verified (sources/, stamps.py), conversions (convert.py).

May import runtime.settings and runtime.errors only.
"""
