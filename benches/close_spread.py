"""The reconnect storm, measured: how long clients whose connections a shutting-down proxy ends
take to be served again by the pod that remains, with the close-spread window at several
lengths (benches/README.md, "The close-spread window").

Two proxies in front of the same apps (tests/close_spread/apps.py: WebSocket, gRPC and TCP
servers): the old pod's, which is shut down, and the remaining pod's. Each client holds a
long-lived connection through the old pod; when it ends (a Close frame, status 14, a FIN or a
reset), the client connects through the remaining pod and waits for its first message there.
Reported per window: the reconnect latency (from the end of the old connection to the first
message on the new one) at p50, p99 and max, and the most reconnects in one second.

Usage: python3 benches/close_spread.py [--binary target/release/lameduck]
       [--windows 0s,2s,5s,10s] [--websockets 1000] [--grpc 200] [--tcp 1000]
"""

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import grpc
from websockets.asyncio.client import connect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = 16


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_proxy(binary, ports, window):
    admin = free_port()
    listens = [free_port() for _ in ports]
    args = [binary, f"--admin=127.0.0.1:{admin}", f"--shutdown-grace-period={GRACE}s",
            "--log=warn"]
    if window is not None:
        args.append(f"--close-spread-window={window}")
    for listen, (port, protocol) in zip(listens, ports):
        args.append(f"--inbound=127.0.0.1:{listen}=127.0.0.1:{port}/{protocol}")
    proxy = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for listen in listens:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=1).close()
                break
            except OSError:
                time.sleep(0.01)
    return proxy, [f"127.0.0.1:{listen}" for listen in listens]


class Client:
    """One long-lived connection through the old pod, then through the remaining one."""

    def __init__(self, kind, old, new, opened, results):
        self.kind, self.old, self.new, self.opened, self.results = kind, old, new, opened, results

    async def run(self):
        await getattr(self, self.kind)(self.old, first=True)
        ended = time.monotonic()
        await getattr(self, self.kind)(self.new, first=False)
        self.results.append((ended, time.monotonic() - ended))

    async def websocket(self, addr, first):
        try:
            async with connect(f"ws://{addr}/", ping_interval=None, open_timeout=120,
                               max_size=None, close_timeout=20) as ws:
                await ws.recv()
                if not first:
                    return
                self.opened.release()
                async for _ in ws:
                    pass
        except Exception:  # noqa: BLE001 - a reset ends it too
            pass

    async def grpc(self, addr, first):
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
        async with grpc.aio.insecure_channel(addr, options=options) as channel:
            call = channel.unary_stream("/test.Stream/Watch")(b"")
            try:
                async for _ in call:
                    if not first:
                        return
                    if self.opened is not None:
                        self.opened.release()
                        self.opened = None
            except grpc.aio.AioRpcError:
                pass

    async def tcp(self, addr, first):
        host, port = addr.rsplit(":", 1)
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"ping")
            await writer.drain()
            await reader.read(65536)
            if first:
                self.opened.release()
                while await reader.read(65536):
                    pass
            writer.close()
        except OSError:
            pass


async def storm(binary, app_ports, window, counts):
    old, old_addrs = start_proxy(binary, app_ports, window)
    new, new_addrs = start_proxy(binary, app_ports, None)
    opened = asyncio.Semaphore(0)
    results = []
    tasks = []
    for kind, index, count in zip(("websocket", "grpc", "tcp"), range(3), counts):
        for i in range(count):
            client = Client(kind, old_addrs[index], new_addrs[index], opened, results)
            tasks.append(asyncio.create_task(client.run()))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
    for _ in range(sum(counts)):
        await opened.acquire()
    await asyncio.sleep(1)
    old.send_signal(signal.SIGTERM)
    await asyncio.wait(tasks, timeout=GRACE + 60)
    old.wait(timeout=30)
    new.send_signal(signal.SIGTERM)
    new.wait(timeout=GRACE + 5)
    latencies = sorted(latency for _, latency in results)
    per_second = {}
    for ended, latency in results:
        second = int(ended + latency)
        per_second[second] = per_second.get(second, 0) + 1

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000

    return {
        "window": window,
        "reconnected": len(latencies),
        "p50_ms": round(pct(0.50), 1),
        "p99_ms": round(pct(0.99), 1),
        "max_ms": round(latencies[-1] * 1000, 1),
        "most_per_second": max(per_second.values()),
    }


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default=os.path.join(ROOT, "target/release/lameduck"))
    parser.add_argument("--windows", default="0s,2s,5s,10s")
    parser.add_argument("--websockets", type=int, default=1000)
    parser.add_argument("--grpc", type=int, default=200)
    parser.add_argument("--tcp", type=int, default=1000)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ports = [free_port() for _ in range(3)]
    apps = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests/close_spread/apps.py"), *map(str, ports)],
        stdout=subprocess.PIPE, text=True)
    apps.stdout.readline()
    app_ports = list(zip(ports, ("http", "http", "tcp")))
    counts = (args.websockets, args.grpc, args.tcp)
    try:
        for window in args.windows.split(","):
            print(json.dumps(await storm(args.binary, app_ports, window, counts)), flush=True)
    finally:
        apps.send_signal(signal.SIGTERM)
        apps.wait(timeout=30)


asyncio.run(main())
