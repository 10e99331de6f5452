"""Test harnesses: ``nspawn`` boots a throw-away real systemd for the systemd/installer suites."""
