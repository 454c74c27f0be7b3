"""`python -m trainer --spec job.json`: run one job without the service.

Protocol lines (JSON, one per line) go to stdout from rank 0; see trainer/protocol.py. A failure
prints an `error` line with the reason and exits 1 (2 for a bad spec: the spec's problems in the
words of the API's 422, "field: rule; ...", from the same models, jobrules/spec.py).
`--check` validates the spec and exits (0: it would start) without training."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import TextIO

from jobrules.spec import JobSpec, SpecError
from trainer.config import load_job
from trainer.distributed import env_rank, env_world_size, teardown
from trainer.priority import cores_given, use_cores, yield_cpu
from trainer.protocol import FileStopSignal, JsonlSink, protocol_channel
from trainer.workspace import UserCodeError, add_environment, set_workspace


def main(argv: list[str] | None = None, *, protocol: TextIO | None = None) -> int:
    """`protocol`: where the protocol lines go (stdout by default; the program's own run passes
    the channel it took before any users' code loads, trainer/protocol.py protocol_channel)."""
    ap = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    ap.add_argument("--spec", required=True, help="JobSpec JSON file ('-' for stdin)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--stop-file", default=None, help="stop cleanly once this file exists")
    ap.add_argument("--workspace", type=Path, default=None, help="the job's unpacked workspace folder")
    ap.add_argument("--pyenv", type=Path, default=None, help="the job's own packages (appended to sys.path)")
    ap.add_argument("--check", action="store_true", help="validate the spec and exit (2 with the reasons)")
    args = ap.parse_args(argv)

    rank = env_rank()
    sink = JsonlSink(protocol or sys.stdout, enabled=rank == 0)
    try:
        raw = json.load(sys.stdin) if args.spec == "-" else json.loads(Path(args.spec).read_text())
        # relative paths and user code need the workspace folder, when the spec names none
        job = load_job(raw, workspace=args.workspace is not None)
        if args.check:
            return 0
        set_workspace(args.workspace)
        add_environment(args.pyenv)
    except (OSError, ValueError) as e:
        sink.error(f"bad spec: {e}")
        return 2
    try:
        from trainer.runner import run

        run(job, sink=sink, stop=FileStopSignal(args.stop_file), checkpoint_dir=args.checkpoint_dir)
    except SpecError as e:
        sink.error(f"bad spec: {e}")
        return 2
    except UserCodeError as e:
        traceback.print_exc()
        sink.log("traceback of the user's code:\n" + "".join(traceback.format_exception(e.__cause__ or e)))
        sink.error(f"user code failed: {e}")
        return 1
    except Exception as e:  # noqa: BLE001 - the reason goes to the worker, the trace to stderr
        traceback.print_exc()
        if uses_user_code(job):  # a shape mismatch in the user's layers: their traceback, in the job's logs
            sink.log("traceback:\n" + traceback.format_exc())
        where = f" (rank {rank} of {env_world_size()})" if env_world_size() > 1 else ""
        sink.error(f"{type(e).__name__}: {e}{where}")
        return 1
    finally:
        teardown()
    return 0


def uses_user_code(job: JobSpec) -> bool:
    return job.model.kind == "python" or job.data.kind == "python"


def exit_now(code: int) -> None:
    """Leave without interpreter finalisation when ranks were involved: with gloo, the static
    destructors that run at a normal exit sometimes abort ("terminate called without an active
    exception") after the process group was already destroyed cleanly, turning a finished run
    into a failed one. Everything the run owed is written and flushed before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    if env_world_size() > 1:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    yield_cpu()
    if (threads := use_cores()) is not None:
        print(
            f"trainer: {threads} torch thread(s), of the {cores_given()} core(s) its worker gave this run",
            file=sys.stderr,
        )
    exit_now(main(protocol=protocol_channel()))
