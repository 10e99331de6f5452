"""Settings: every key of ``pdctl.toml`` with its type, default and check (``schema``), reading, checking and
writing the file with errors that name file and key (``config``), and the plan flags of the command line with
the source of each value (``cliargs``).

The first stage of the data walk: everything downstream reads its defaults here; nothing here knows a plan.

May import: (shared leaves only)
"""
