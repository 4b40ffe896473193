#!/usr/bin/env python3
"""A plain TCP relay for the local test cluster (scripts/testenv): pods on the real node reach the API
server, which listens only on the host's loopback, through this relay on the host's bridge address. The
bytes are relayed unchanged (TLS stays end to end; pods verify the API server's certificate by its
`kubernetes` name).

usage: tcp-relay.py LISTEN_HOST TARGET_HOST:PORT READY_FILE   (listens on a free port, writes it to READY_FILE)
"""
import asyncio
import sys


async def pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def main():
    listen_host, target, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    thost, tport = target.rsplit(":", 1)

    async def handle(cr, cw):
        try:
            ur, uw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    server = await asyncio.start_server(handle, listen_host, 0)
    port = server.sockets[0].getsockname()[1]
    with open(ready + ".tmp", "w") as f:
        f.write(str(port))
    import os
    os.replace(ready + ".tmp", ready)
    async with server:
        await server.serve_forever()


asyncio.run(main())
