"""The per-request rules, pure and shared by the live proxy and the twin's simulator (so what-if predicts
what the proxy does): ``decide`` (aggregate on one worker, or split into a P and a D leg) and ``admit``
(start now, wait in the proxy's bounded queue, or refuse with Retry-After, by the SLO).

No I/O, no clock, no randomness.

May import: settings
"""
