"""ASGI entry point: `uvicorn api.asgi:app`."""

import gc
import sys

from api.main import create_app
from core.telemetry import time_gc

# The request threads hand the interpreter lock back and forth with the event loop (streams) and
# each other; a thread back from I/O waits up to this long for a busy holder to let go. 1 ms
# instead of Python's 5 ms: bench/api_load.py p95 114-117 ms against 131-137 ms, p99 about 220
# against 340-370 ms, back-to-back runs at load average 3.2-4.3.
SWITCH_INTERVAL_S = 0.001
sys.setswitchinterval(SWITCH_INTERVAL_S)

app = create_app()

# Everything made so far (modules, the app, its routes and models) lives as long as the process: out
# of the collector's sight, so a full collection walks only what requests made since. Under load
# its pauses held every request at once (bench/api_load.py: gen-2 collections of 300-530 ms over
# ~170k objects, the worst tail of POST /api/jobs).
gc.collect()
gc.freeze()
time_gc()
# A full collection still walks everything made since: with 500 streams open it held the process
# 100-115 ms (shardyard_gc_pause_seconds; bench/api_load.py: the slowest requests of each run, a
# GET and a POST of 120-164 ms in one burst). Python starts one after every 10 collections of the
# middle generation (when a quarter more objects have lived that long); after every 100, they come
# a tenth as often. The young generations are collected as before, so most cycles still go young.
FULL_AFTER_MIDDLE = 100
young, middle, _ = gc.get_threshold()
gc.set_threshold(young, middle, FULL_AFTER_MIDDLE)
