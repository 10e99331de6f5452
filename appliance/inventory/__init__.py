"""GPU inventory: what the box has, from NVML, a fake spec or a replayed JSON file.

``detect(spec)`` is the only entry point; the planner receives the resulting ``Inventory`` and never
calls NVML itself.

May import: (shared leaves only)
"""
from .detect import detect
from .model import GPU, NA, Inventory, InventoryError, is_na

__all__ = ["GPU", "NA", "Inventory", "InventoryError", "detect", "is_na"]
