"""A real S3-compatible server (moto's server mode) on a free loopback port.

Run as `python s3_server.py`; it prints `S3 <port>` once it accepts requests and exits when
its stdin closes, so the test fixture that started it controls its lifetime.
"""

import logging
import sys

from moto.server import ThreadedMotoServer

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(f"S3 {server.get_host_and_port()[1]}", flush=True)
sys.stdin.read()
server.stop()
