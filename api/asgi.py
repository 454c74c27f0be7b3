"""ASGI entry point: `uvicorn api.asgi:app`."""

import gc
import sys

from api.main import create_app

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
