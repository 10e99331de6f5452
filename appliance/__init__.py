"""pdctl appliance core: UI-free building blocks (inventory, planner, config, units, proxy, twin, collector)."""

__version__ = "0.1.0"
