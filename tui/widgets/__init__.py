"""Reusable widgets: text bars, the TTFT chart with its SLO line, the confirm and help screens."""
