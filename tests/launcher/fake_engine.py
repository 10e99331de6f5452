"""A tiny real engine for launcher tests: binds its port at once, answers /health 503 until loaded.

Like vLLM it listens before it is ready. Knobs (argv): --port, --load S (503 before), --hang (accept
/health but never answer while loading), --sick-file F (503 while F exists), --exit-file F (exit 3
when F appears), --ignore-term, --grandchild F (spawn a `sleep` in our group, write its pid to F),
--marker F (append received signal names).
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--load", type=float, default=0.0)
ap.add_argument("--hang", action="store_true")
ap.add_argument("--sick-file")
ap.add_argument("--exit-file")
ap.add_argument("--ignore-term", action="store_true")
ap.add_argument("--grandchild")
ap.add_argument("--marker")
a, _unknown = ap.parse_known_args()  # engine flags it does not model (e.g. --kv) are ignored
t0 = time.monotonic()


def mark(text):
    if a.marker:
        with open(a.marker, "a") as f:
            f.write(text + "\n")


class H(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        loading = time.monotonic() - t0 < a.load
        if loading and a.hang:
            time.sleep(30)
            return
        ok = self.path == "/health" and not loading and not (a.sick_file and os.path.exists(a.sick_file))
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()


srv = ThreadingHTTPServer(("127.0.0.1", a.port), H)
srv.daemon_threads = True
print(f"fake engine on {a.port} env PDCTL_TEST={os.environ.get('PDCTL_TEST')} "
      f"NOTIFY_SOCKET={os.environ.get('NOTIFY_SOCKET')}", flush=True)
if a.grandchild:
    g = subprocess.Popen(["sleep", "300"])
    with open(a.grandchild, "w") as f:
        f.write(str(g.pid))


def on_signal(signum, _frame):
    mark(signal.Signals(signum).name)
    if a.ignore_term:
        return
    threading.Thread(target=srv.shutdown, daemon=True).start()


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on_signal)
if a.exit_file:
    def watch():
        while not os.path.exists(a.exit_file):
            time.sleep(0.05)
        os._exit(3)
    threading.Thread(target=watch, daemon=True).start()
srv.serve_forever(poll_interval=0.05)
sys.exit(0)
