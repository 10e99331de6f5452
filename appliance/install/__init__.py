"""Install: the plan onto a host. ``cli`` (``pdctl install|apply|uninstall``: detect -> plan -> config ->
units -> user -> systemd -> ready), ``preflight`` (every refusal, found at once), ``pathcheck`` (can the
service user reach a path; run by install.sh with the bare system Python), ``units`` (the install tree rendered
from the plan, pure), ``resources`` (where the unit templates live), ``host`` (the commands run as root),
``rollout`` (write what differs, restart only what changed), ``rolling`` (workers one batch at a time, drained and
canaried), ``upgrade`` (``pdctl upgrade``: another engine release, rolled back on failure; doctor's version checks
first) and ``readiness`` (the wait for /ready).

May import: settings, model, inventory, plan, wire, keys, doctor
"""
