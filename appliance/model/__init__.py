"""The model: its profile (weights bytes, KV bytes per token: ``profiles``), its download from a hub into
pdctl's cache, verified (``fetch``, ``hub_report``), and ``pdctl model fetch|path`` (``cli``).

May import: settings
"""
