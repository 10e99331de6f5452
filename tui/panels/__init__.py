"""Render-only panels: each takes widgets and one Snapshot and draws; none fetches or acts."""
