"""The clients in tests/close_spread.rs: WebSockets, gRPC server streams (one channel, so one
connection, each) and TCP streams, all through the proxy, none ending by itself. Prints
"ready" once all are open, then one JSON object per connection as it ends: its kind, how it
ended and when (time.time()), then "done" once all have ended or the limit has passed.

Usage: clients.py WS_ADDR GRPC_ADDR TCP_ADDR WEBSOCKETS GRPC_STREAMS TCP_STREAMS LIMIT_SECONDS
"""

import asyncio
import json
import resource
import socket
import sys
import time

import grpc
import websockets
from websockets.asyncio.client import connect


def report(kind, how):
    print(json.dumps({"kind": kind, "how": how, "at": time.time()}), flush=True)


async def websocket_client(addr, opened):
    async with connect(f"ws://{addr}/", ping_interval=None, open_timeout=60, max_size=None) as ws:
        opened.release()

        async def talk():
            size = 3
            while True:
                await ws.send(b"c" * size)
                size = size * 5 % 25013 + 1
                await asyncio.sleep(1)

        talker = asyncio.create_task(talk())
        try:
            async for _ in ws:
                pass
            # A clean closing handshake, and the TCP connection closed after it.
            report("websocket", f"close:{ws.protocol.close_rcvd.code}")
        except websockets.ConnectionClosedError as error:
            code = error.rcvd.code if error.rcvd else "none"
            report("websocket", f"error:{code}:{error}")
        finally:
            talker.cancel()


async def grpc_client(addr, opened):
    # A channel of its own (not the process-wide subchannel pool): a connection per stream.
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
    async with grpc.aio.insecure_channel(addr, options=options) as channel:
        watch = channel.unary_stream("/test.Stream/Watch")
        call = watch(b"")
        first = True
        try:
            async for _ in call:
                if first:
                    first = False
                    opened.release()
            report("grpc", f"ended:{(await call.code()).value[0]}")
        except grpc.aio.AioRpcError as error:
            report("grpc", f"status:{error.code().value[0]}:{error.details()}")


async def tcp_client(addr, opened):
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    opened.release()

    async def talk():
        while True:
            writer.write(b"ping")
            await writer.drain()
            await asyncio.sleep(1)

    talker = asyncio.create_task(talk())
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                report("tcp", "fin")
                break
    except ConnectionResetError:
        report("tcp", "reset")
    finally:
        talker.cancel()
        writer.close()


async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ws_addr, grpc_addr, tcp_addr = sys.argv[1:4]
    n_ws, n_grpc, n_tcp, limit = map(int, sys.argv[4:8])
    total = n_ws + n_grpc + n_tcp
    opened = asyncio.Semaphore(0)
    tasks = []
    # Opened a few at a time: the apps' accept queues are not the subject here.
    for i in range(max(n_ws, n_grpc, n_tcp)):
        if i < n_ws:
            tasks.append(asyncio.create_task(websocket_client(ws_addr, opened)))
        if i < n_grpc:
            tasks.append(asyncio.create_task(grpc_client(grpc_addr, opened)))
        if i < n_tcp:
            tasks.append(asyncio.create_task(tcp_client(tcp_addr, opened)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)
    for _ in range(total):
        await opened.acquire()
    print("ready", flush=True)
    done, pending = await asyncio.wait(tasks, timeout=limit)
    for task in done:
        if task.exception() is not None:
            report("error", repr(task.exception()))
    for task in pending:
        task.cancel()
    print(f"done {len(pending)} still open", flush=True)


asyncio.run(main())
