"""A TCP proxy in front of the S3 server that can fail on command, for transient-fault tests.

Run as `python faulty_proxy.py TARGET_PORT`; it prints `PROXY <port>` once listening. Then,
per line on stdin: `refuse SECONDS` drops every open connection and, for that many seconds,
closes each new one at once (as a server that is restarting would); it answers `OK`.
"""

import asyncio
import sys
import time

refuse_until = 0.0
open_writers: set = set()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: int) -> None:
    if time.monotonic() < refuse_until:
        client_w.transport.abort()
        return
    try:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        client_w.transport.abort()
        return
    open_writers.update((client_w, server_w))
    await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
    open_writers.difference_update((client_w, server_w))


async def control() -> None:
    global refuse_until
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command, _, arg = line.strip().partition(" ")
        if command == "refuse":
            refuse_until = time.monotonic() + float(arg)
            for w in list(open_writers):
                w.transport.abort()
        print("OK", flush=True)


async def main(target: int) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, target), "127.0.0.1", 0)
    print(f"PROXY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await control()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
