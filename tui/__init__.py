"""``pdctl tui``: a Textual dashboard that only renders Snapshots from an injected source."""
