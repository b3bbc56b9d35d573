"""Run the 2-rank FSDP1 fit of ``scripts/fsdp1_fit.py`` N times, each as its own launched
processes, and count the runs that did not exit 0 -- a finished multi-rank fit must exit 0 every
time (issue 34: 4 of 72 runs aborted at interpreter shutdown, "terminate called without an
active exception", exit -6, after the fit had written its results).

    python scripts/exit_loop.py -n 50 [--launch lightning|torchrun] [--timeout-s 300]
                                [--python PY] [--clone DIR]

``--launch torchrun`` (default) runs it under ``python -m torch.distributed.run --nproc_per_node
2``, which exits non-zero when any rank does; ``--launch lightning`` runs ``python
scripts/fsdp1_fit.py`` (Lightning's launcher starts the second rank, and the exit code is rank
0's alone: a rank 1 abort shows only in the output). A run counts as bad when it exits non-zero
or its output says "terminate called". ``--clone`` runs another checkout's copy (the code before a fix). Prints
one line per run, then the counts: exit codes, runs whose fit finished (``done.json``), runs
whose output says "terminate called". About 50 s a run on a loaded 2-core machine (importing
Lightning is most of it).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    """A port nothing listens on now (another loop, a test's run, may be using a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--launch", choices=("lightning", "torchrun"), default="torchrun")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--clone", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--keep", default=None, help="keep each run's output under this folder")
    args = ap.parse_args(argv)
    clone = Path(args.clone).resolve()
    script = clone / "scripts" / "fsdp1_fit.py"
    if not script.is_file():
        sys.exit(f"error: {script} not found; --clone must be a checkout with scripts/fsdp1_fit.py")
    env = dict(os.environ, PYTHONPATH=str(clone), PYTHONUNBUFFERED="1")
    codes: collections.Counter = collections.Counter()
    finished = terminate = bad = 0
    started = time.time()
    root = Path(args.keep or tempfile.mkdtemp(prefix="exit_loop_"))
    for i in range(args.n):
        out = root / f"run{i:03d}"
        cmd = [args.python, str(script), str(out), "--launch", args.launch]
        if args.launch == "torchrun":
            cmd = [args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(_free_port()), *cmd[1:]]
        t0 = time.time()
        # a session of its own: on a timeout the whole run goes (Lightning's launcher leaves its
        # second rank behind when only the first is killed)
        proc = subprocess.Popen(cmd, env=env, cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=args.timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            rc = "timeout"
        out.mkdir(parents=True, exist_ok=True)
        (out / "log.txt").write_text(text or "")
        done = (out / "done.json").is_file()
        aborted = "terminate called" in str(text)
        codes[rc] += 1
        bad += rc != 0 or aborted
        finished += done
        terminate += aborted
        print(f"run {i + 1:3d}/{args.n}: exit {rc}  fit finished: {done}  'terminate called': {aborted}  "
              f"({time.time() - t0:.0f} s)", flush=True)
    print(f"\n{args.n} runs ({args.launch} launch, {clone}), {time.time() - started:.0f} s: "
          f"{bad} bad (not exit 0, or 'terminate called'); exit codes {dict(codes)}; fit finished in {finished}; 'terminate called' in {terminate}; "
          f"logs under {root}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
