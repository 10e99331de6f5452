"""What the operator reads of an installed box, beside the collector that measures it: ``pdctl status`` (``status``,
``cli``), ``pdctl logs`` (``journal``), the TUI's unit actions (``actions``), ``pdctl export prometheus|llm-d``
(``monitoring``, ``export``).

Views render what the collector measured; they measure nothing themselves.

May import: settings, policy, inventory, plan, collector, fleet, keys
"""
