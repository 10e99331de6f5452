"""The front door's keys: who may use the public port, in which class and under which limits.

``table`` owns the keys file (``[proxy] keys_file``: one ``[[key]]`` entry per caller, SHA-256 digests, its
permissions and every error naming file, entry and fix); ``quota`` counts each key's use against its limits
(requests and tokens per minute, concurrent requests, tokens per UTC day) and says when and why to refuse;
``audit`` shapes the journal entries of the audit trail (one per request while keys are on, one per key change);
``cli`` is ``pdctl keys add|list|revoke|rotate`` (atomic edits, the key printed once, the proxy reloaded).
The proxy (proxy/guard.py) asks ``table`` who sent a request and ``quota`` whether it may pass.

May import: settings, plan
"""
