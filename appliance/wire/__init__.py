"""pdctl's one HTTP/1.1 layer: a server (server.py, http1.py), a keep-alive client (client.py) and the
Prometheus text format (prom.py), shared by the proxy, the collector, the twin's surfaces and the benchmarks.

May import: settings
"""
