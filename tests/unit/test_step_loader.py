"""The training DataLoader's workers outlive the launcher's SIGTERM.

The ``deepspeed`` launcher answers Ctrl-C with SIGTERM to every process under the trainer,
loader workers included; a worker that died of it made the trainer's next batch fail
before it could save its checkpoint (CI, 2026-11-26: "DataLoader worker exited
unexpectedly" after Ctrl-C with wandb on). wandb's OpenTelemetry exporters restart their
threads in every forked child before ``worker_init_fn`` runs; the script below starts such a
thread from a fork hook, as they do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
from builders import ROOT

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch
    from msd_train.data.collate import step_loader
    from msd_train.data.curriculum import Curriculum

    # A library's fork hook starting a thread in the child (wandb's OpenTelemetry exporters do).
    os.register_at_fork(after_in_child=lambda: threading.Thread(target=time.sleep, args=(600,), daemon=True).start())

    class Steps(torch.utils.data.Dataset):
        def __getitem__(self, item):
            step, plan, cursor = item
            return {"step": step, "cursor": cursor, "x": torch.full((4096,), float(step))}

    steps = iter(step_loader(Steps(), Curriculum(8, 0, 2, 0, 0.0, 0.0, 0, "linear"), 0, 10**6, 2, False))
    assert next(steps)["step"] == 0
    print(json.dumps([w.pid for w in steps._workers]), flush=True)
    sys.stdin.readline()  # the test has sent SIGTERM to every worker
    got = [next(steps)["step"] for _ in range(8)]
    assert got == list(range(1, 9)), got
    print("ok", flush=True)
""")


def test_loader_workers_outlive_a_sigterm_from_the_launcher_even_with_threads_started_at_fork():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = [psutil.Process(pid) for pid in json.loads(proc.stdout.readline() or "null")]
        assert len(workers) == 2
        for w in workers:  # from this process, as the launcher's SIGTERM comes from outside the trainer
            deadline = time.monotonic() + 60  # the fork hook's thread and worker_init_fn's: the worker is set up
            while len(w.threads()) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(w.threads()) >= 3, "the worker never started the fork hook's thread and its own"
            os.kill(w.pid, signal.SIGTERM)
        psutil.wait_procs(workers, timeout=1)
        assert all(w.is_running() for w in workers), "a loader worker died of the launcher's SIGTERM"
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "ok", err[-3000:]
