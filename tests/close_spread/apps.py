"""The apps behind the proxy in tests/close_spread.rs: a WebSocket server, a gRPC server with
one server-streaming method, and a TCP echo server, on 127.0.0.1. None of them ends a
connection by itself; each records how each of its connections ended, and prints the counts as
JSON on stdout when SIGTERM arrives.

Usage: apps.py WS_PORT GRPC_PORT TCP_PORT
"""

import asyncio
import json
import resource
import signal
import sys
from collections import Counter

import grpc
import websockets
from websockets.asyncio.server import serve

ends = Counter()


async def websocket_handler(ws):
    # Messages both ways, of sizes that span several reads, so that the proxy's Close frame
    # has to wait for frame boundaries.
    async def talk():
        size = 1
        while True:
            await ws.send(b"s" * size)
            size = size * 7 % 30011 + 1
            await asyncio.sleep(1)

    talker = asyncio.create_task(talk())
    try:
        async for _ in ws:
            pass
        ends[f"websocket:{ws.protocol.close_rcvd.code}"] += 1
    except websockets.ConnectionClosedError as error:
        ends[f"websocket:error:{error.rcvd.code if error.rcvd else 'none'}"] += 1
    finally:
        talker.cancel()


async def watch(request, context):
    try:
        size = 1
        while True:
            yield b"g" * size
            size = size * 7 % 20011 + 1
            await asyncio.sleep(1)
    except (asyncio.CancelledError, GeneratorExit):
        # Cancelled while it waited (CancelledError) or while its message was being written
        # (the generator is closed).
        ends["grpc:cancelled"] += 1
        raise


async def tcp_handler(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                ends["tcp:fin"] += 1
                break
            writer.write(data)
            await writer.drain()
    except ConnectionResetError:
        ends["tcp:reset"] += 1
    except Exception as error:  # noqa: BLE001 - recorded, not hidden
        ends[f"tcp:error:{type(error).__name__}"] += 1
    finally:
        writer.close()


async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ws_port, grpc_port, tcp_port = map(int, sys.argv[1:4])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1000)])
    handler = grpc.method_handlers_generic_handler(
        "test.Stream", {"Watch": grpc.unary_stream_rpc_method_handler(watch)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    tcp = await asyncio.start_server(tcp_handler, "127.0.0.1", tcp_port, backlog=4096)
    async with serve(websocket_handler, "127.0.0.1", ws_port, backlog=4096, ping_interval=None):
        print("listening", flush=True)
        await stop.wait()
    tcp.close()
    await server.stop(None)
    print(json.dumps(dict(ends)), flush=True)


asyncio.run(main())
