"""``pdctl doctor``: one command that checks what breaks P/D boxes in the field and says how to fix each.

UI-free core: ``run_doctor(plan) -> list[Check]`` (checks.py; live reads in probe.py, the tested version
pairs in pairs.py); ``render.py`` turns the checks into a table or JSON; ``cli.py`` is the verb.

May import: settings, model, inventory, plan, collector, wire, keys
"""
from .checks import Check, exit_code, run_doctor

__all__ = ["Check", "exit_code", "run_doctor"]
