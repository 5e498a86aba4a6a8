"""The app of the pod test: an HTTP/1.1 server on port 8080 that calls an upstream for every
request, as a real service calls others: through the proxy's outbound route (127.0.0.1:4140), or
at $UPSTREAM (host:port) when the pod's traffic is intercepted.

  app.py graceful   on SIGTERM: close the listener, finish what it has, make one last call
                    through the outbound route (a flush, a deregistration), exit 0 (3 if that
                    call failed)
  app.py immediate  on SIGTERM: exit at once

With KEEP_ALIVE_REQUESTS=N it closes each connection after N requests (the last response says
`Connection: close`), as servers bound their keep-alive connections. With RECORD_READS=1 it
prints `app: read id=N` for each request it reads, before it can exit (see RecordingReader).
"""

import http.client
import http.server
import io
import os
import re
import select
import signal
import sys
import threading
import time

MODE = sys.argv[1]
_host, _, _port = os.environ.get("UPSTREAM", "127.0.0.1:4140").rpartition(":")
OUTBOUND = (_host, int(_port))
KEEP_ALIVE_REQUESTS = int(os.environ.get("KEEP_ALIVE_REQUESTS", "0"))
RECORD_READS = os.environ.get("RECORD_READS") == "1"
# Held while bytes are taken from a connection and the ids in them printed, and by an
# immediate exit: a request the app read is on record even when the app exits right after.
READING = threading.Lock()


class RecordingReader(io.RawIOBase):
    """A connection's bytes as its handler reads them, each request id in them printed as they
    leave the kernel. A request the app read, and then died with, reached it: the test must not
    count it as one that never did, as the upstream's record alone would."""

    def __init__(self, sock):
        self.sock = sock
        # The bytes after the last id found, where an id cut between two reads begins.
        self.tail = b""

    def readable(self):
        return True

    def readinto(self, buffer):
        # Waits outside the lock (the socket's own timeout applies), reads within it. poll,
        # not select: a busy app's descriptors may pass select's limit.
        waiting = select.poll()
        waiting.register(self.sock, select.POLLIN)
        timeout = self.sock.gettimeout()
        if not waiting.poll(None if timeout is None else timeout * 1000):
            raise TimeoutError("timed out")
        with READING:
            count = self.sock.recv_into(buffer)
            data = self.tail + bytes(buffer[:count])
            end = 0
            for found in re.finditer(rb"[?&]id=(\d+)[ &]", data):
                print(f"app: read id={int(found.group(1))}", flush=True)
                end = found.end()
            self.tail = data[end:][-64:]
        return count


def call_upstream(path):
    conn = http.client.HTTPConnection(*OUTBOUND, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError as error:
        print(f"app: {path} through the outbound route failed: {error}", flush=True)
        return 0
    finally:
        conn.close()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Idle keep-alive connections end after a second, so that a graceful shutdown ends.
    timeout = 1

    def do_GET(self):
        if self.path == "/healthz":
            # The readiness probe: the app itself, no upstream.
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/hook-sleep?s="):
            # The app's own httpGet preStop hook: its own wait before the kubelet signals it.
            time.sleep(float(self.path.partition("=")[2]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        # The query names the client's request, so the test can match the upstream's record.
        query = self.path.partition("?")[2]
        status = call_upstream("/upstream?" + query)
        body = b"ok\n" if status == 200 else f"upstream answered {status}\n".encode()
        self.send_response(200 if status == 200 else 502)
        self.send_header("Content-Length", str(len(body)))
        self.served = getattr(self, "served", 0) + 1
        if KEEP_ALIVE_REQUESTS and self.served >= KEEP_ALIVE_REQUESTS:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        # The body, read whole; then as a GET: the upstream's record names the request.
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.do_GET()

    def setup(self):
        super().setup()
        if RECORD_READS:
            self.rfile = io.BufferedReader(RecordingReader(self.connection))

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True


server = Server(("0.0.0.0", 8080), Handler)


def on_sigterm(*_):
    print(f"app: SIGTERM ({MODE})", flush=True)
    if MODE == "immediate":
        # Never between a read and its record (RecordingReader).
        READING.acquire()
        os._exit(0)
    threading.Thread(target=server.shutdown).start()


signal.signal(signal.SIGTERM, on_sigterm)
print("app: listening on port 8080", flush=True)
server.serve_forever()
server.server_close()
status = call_upstream("/flush")
print(f"app: last call through the outbound route answered {status}", flush=True)
sys.exit(0 if status == 200 else 3)
