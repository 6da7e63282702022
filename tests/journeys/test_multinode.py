"""Two "nodes" of two ranks each on one machine (torchrun, gloo), a shared run_dir and
node-local caches and temporary folders: stage 1 (stopped by one node, resumed), stage 2, eval.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from builders.runs import ENV, steps, wait_for_steps

from msd_train.runtime import free_port
from msd_train.training import checkpoint as ckpt

ROOT = ENV["PYTHONPATH"]
FAST = ["logging.wandb.mode=disabled", "logging.progress=false", "data.max_heldout=4", "eval.every=1000",
        "train.micro_batch_size=1", "train.grad_accum=1", "checkpoint.every=2"]


@pytest.fixture
def tmp_path():
    """A short folder in place of pytest's: the nodes' TMPDIRs live in it, and the loader workers'
    sockets need a TMPDIR of at most 75 bytes (``msd_train.validate.check_worker_tmpdir``), which
    pytest's folders can pass (under pytest-xdist, or a long user name)."""
    d = Path(tempfile.mkdtemp(prefix="msd-nodes-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def launch(tmp_path, args, nodes=2, per_node=2, cache=lambda k: f"node{k}/cache"):
    """One ``torchrun`` per node, each in its own session, with its own cache and TMPDIR (what a
    node's local disk would hold); the run_dir is the same folder for all (shared storage)."""
    port, procs = free_port(), []
    for k in range(nodes):
        tmp = tmp_path / f"node{k}" / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
               str(per_node), "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", str(port),
               f"{ROOT}/train.py", *args, f"data.cache_dir={tmp_path / cache(k)}"]
        log = open(tmp_path / f"node{k}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "TMPDIR": str(tmp)}, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def signal_node(proc, sig):
    """``sig`` to a node's launcher and every process under it (torchrun starts each rank in a session of its own)."""
    import psutil

    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def finish(tmp_path, procs, ok=True):
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                signal_node(p, signal.SIGKILL)
    out = [(tmp_path / f"node{k}.log").read_text() for k in range(len(procs))]
    if ok and any(codes):
        raise AssertionError(f"exit codes {codes}:\n" + "\n".join(o[-4000:] for o in out))
    return out


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_both_stages_stop_resume_and_evaluate(tmp_path):
    run = tmp_path / "run"
    stage1 = ["stage=1", f"run_dir={run}", "train.max_steps=10", *FAST]

    # stage 1, stopped by one node: SIGTERM to every process of node 1 (a preempted node)
    procs = launch(tmp_path, stage1)
    wait_for_steps(run, procs[0], 2)
    signal_node(procs[1], signal.SIGTERM)
    out = finish(tmp_path, procs, ok=False)
    assert not (run / "stage1" / "final").exists(), "the run finished before it could be stopped"
    saved = ckpt.complete_checkpoints(run / "stage1" / "checkpoints")
    assert saved and any("checkpoint saved" in o for o in out), "\n".join(o[-3000:] for o in out)
    stopped_at = ckpt.read_state(saved[-1])["step"]
    assert f"interrupted at step {stopped_at}" in out[0]  # rank 0 says where the job stopped

    # data: prepared on each node into its own cache (by its first rank), once; said once, by rank 0
    said = "is each node's own: the data is prepared once per node (2 nodes)"
    assert out[0].count(said) == 1 and said not in out[1]
    caches = [sorted(p.parent.name for p in (tmp_path / f"node{k}" / "cache").glob("split-*/manifest.json")) for k in (0, 1)]
    assert caches[0] and caches[0] == caches[1]
    assert not list((tmp_path / "node0" / "cache").glob(".msd-node-*"))  # the markers are removed

    # the same commands resume; SIGKILL to node 1 after its next checkpoint (a node lost): the other stops, saying so
    procs = launch(tmp_path, stage1)
    deadline = time.time() + 300
    while time.time() < deadline and procs[0].poll() is None and \
            ckpt.read_state(ckpt.complete_checkpoints(run / "stage1" / "checkpoints")[-1])["step"] == stopped_at:
        time.sleep(0.05)
    signal_node(procs[1], signal.SIGKILL)
    out = finish(tmp_path, procs, ok=False)
    assert f"resuming from {run / 'stage1' / 'checkpoints' / f'step-{stopped_at:06d}'}" in out[0]
    assert not (run / "stage1" / "final").exists(), "the run finished before node 1 could be killed"
    newest = ckpt.complete_checkpoints(run / "stage1" / "checkpoints")[-1]
    assert procs[0].returncode != 0 and "error: another process of this job is gone during step" in out[0]
    assert f"the newest checkpoint ({newest}) are lost; launch the same command again on every node" in out[0]

    out = finish(tmp_path, launch(tmp_path, stage1))
    assert f"resuming from {newest}" in out[0]
    assert steps(run) == list(range(1, 11))  # each step logged once, by one rank, none repeated after the resumes
    assert out[0].count(f"exported {run / 'stage1' / 'final'}") == 1 and "exported" not in out[1]  # once, by rank 0
    assert not list((run / "stage1" / "checkpoints").glob(".tmp-*"))

    # stage 2 from stage 1's export, then eval.py on its head
    out = finish(tmp_path, launch(tmp_path, ["stage=2", f"run_dir={run}", "train.max_steps=2", *FAST]))
    assert steps(run, 2) == [1, 2] and (run / "stage2" / "final" / "model.safetensors").exists()
    eval_out = tmp_path / "eval"
    res = subprocess.run([sys.executable, f"{ROOT}/eval.py", f"draft={run / 'stage2' / 'final'}", f"out={eval_out}",
                          "bench.max_per_category=1", "decoding.max_new_tokens=8", "warmup=0", "progress=false"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((eval_out / "report.json").read_text())["bench"] == "tiny"


@pytest.mark.slow
def test_a_cache_shared_by_some_nodes_only_is_refused_and_one_shared_by_all_is_prepared_once(tmp_path):
    """Nodes 0 and 1 see one data.cache_dir, node 2 its own: neither once per job nor once per
    node is safe; every rank stops naming the nodes and the fix, before any data is read. The fix
    (one folder for all) trains, the data prepared once for the job."""
    args = ["stage=1", f"run_dir={tmp_path / 'run'}", "train.max_steps=1", *FAST]
    out = finish(tmp_path, launch(tmp_path, args, nodes=3, per_node=1,
                                  cache=lambda k: "shared/cache" if k < 2 else "node2/cache"), ok=False)
    for o in out:
        assert "data.cache_dir=" in o and "nodes that see the same folder: {0, 1}, {2}" in o, o[-3000:]
        assert "on storage every node shares, or to a path on each node's own disk" in o
    assert not (tmp_path / "run" / "stage1" / "metrics.jsonl").exists()
    assert not list((tmp_path / "node2" / "cache").glob("split-*"))

    out = finish(tmp_path, launch(tmp_path, args, nodes=3, per_node=1, cache=lambda k: "shared/cache"))
    assert out[0].count("is shared by the 3 nodes: the data is prepared once for the job, by rank 0") == 1
    assert steps(tmp_path / "run") == [1] and list((tmp_path / "shared" / "cache").glob("split-*/manifest.json"))


@pytest.fixture
def loopback_hosts(tmp_path):
    """Two "hosts" for ``deepspeed --hostfile``: an sshd on 127.0.0.1 and one on 127.0.0.2 (same
    port, a key made here, nothing outside loopback), each giving its sessions a node-local
    HF_DATASETS_CACHE (so the default data.cache_dir) and TMPDIR. Needs the Debian packages
    openssh-server and pdsh (``apt-get install -y openssh-server pdsh``) and root."""
    if not (shutil.which("pdsh") and os.path.exists("/usr/sbin/sshd") and os.geteuid() == 0):
        pytest.skip("deepspeed --hostfile needs pdsh and sshd (apt-get install -y openssh-server pdsh) and root")
    d, port = tmp_path / "ssh", free_port()
    d.mkdir()
    for name in ("key", "hostkey"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "key.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True)
    daemons = []
    for k in (1, 2):
        (tmp_path / f"host{k}" / "tmp").mkdir(parents=True)
        (d / f"sshd{k}.conf").write_text(
            f"ListenAddress 127.0.0.{k}:{port}\nHostKey {d / 'hostkey'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
            f"PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\n"
            f"PidFile {d / f'sshd{k}.pid'}\n"
            f"SetEnv HF_DATASETS_CACHE={tmp_path / f'host{k}' / 'cache'} TMPDIR={tmp_path / f'host{k}' / 'tmp'}\n")
        daemons.append(subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(d / f"sshd{k}.conf"), "-E",
                                         str(d / f"sshd{k}.log")]))
    env = {**ENV, "PDSH_SSH_ARGS_APPEND": f"-i {d / 'key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                                          f"-o BatchMode=yes -o ConnectTimeout=5"}
    deadline = time.time() + 30
    while subprocess.run(["ssh", "-p", str(port), *env["PDSH_SSH_ARGS_APPEND"].split(), "127.0.0.2", "true"],
                         capture_output=True).returncode and time.time() < deadline:
        time.sleep(0.2)
    yield port, env
    for p in daemons:
        p.terminate()
        p.wait()


@pytest.mark.slow
def test_deepspeed_hostfile_two_hosts_of_two_ranks(tmp_path, loopback_hosts):
    """DeepSpeed's own multi-node path (pdsh over ssh to each host of the hostfile), two loopback
    hosts of two ranks, each with its own cache: prepared once per host, exported once."""
    port, env = loopback_hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    run = tmp_path / "run"
    cmd = ["deepspeed", "--hostfile", str(hostfile), "--ssh_port", str(port), "--no_ssh_check",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), f"{ROOT}/train.py",
           "stage=1", f"run_dir={run}", "train.max_steps=3", *FAST]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert out.count("is each node's own: the data is prepared once per node (2 nodes)") == 1
    caches = [sorted(p.parent.name for p in (tmp_path / f"host{k}" / "cache" / "datasets").glob("split-*/manifest.json"))
              for k in (1, 2)]
    assert caches[0] and caches[0] == caches[1]
    assert steps(run) == [1, 2, 3] and out.count(f"exported {run / 'stage1' / 'final'}") == 1


@pytest.mark.slow
def test_a_hostfile_host_that_ssh_cannot_reach_is_one_message(tmp_path, loopback_hosts):
    """127.0.0.3 has no sshd: its ranks never start; the others stop at the end of the wait,
    naming what to check (here after dist.timeout_minutes=0.3 instead of the default 120)."""
    port, env = loopback_hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.3 slots=2\n")
    cmd = ["deepspeed", "--hostfile", str(hostfile), "--ssh_port", str(port), "--no_ssh_check",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), f"{ROOT}/train.py",
           "stage=1", f"run_dir={tmp_path / 'run'}", "train.max_steps=3", "dist.timeout_minutes=0.3", *FAST]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "127.0.0.3: ssh: connect to host 127.0.0.3" in out  # pdsh names the host
    assert "error: not every process of the job joined within dist.timeout_minutes=0.3" in out, out[-5000:]
    assert "2/4 clients joined" in out and "Check `ssh HOST true` for every host" in out
    assert not (tmp_path / "run" / "stage1" / "metrics.jsonl").exists()


def test_a_hostfile_host_that_cannot_be_reached_stops_the_launch_at_once(tmp_path):
    """What ``deepspeed --hostfile`` starts on the first host (``deepspeed.launcher.launch`` with
    the hosts in ``--world_info``), for a hostfile whose second host does not exist: every rank
    checks the hosts before joining, so the launch stops in seconds naming the host and the fix,
    instead of after dist.timeout_minutes, and nothing is written."""
    import base64

    bad = "msd-node-that-does-not-exist.invalid"  # RFC 6761: never resolves
    world = base64.urlsafe_b64encode(json.dumps({"127.0.0.1": [0], bad: [0]}).encode()).decode()
    run = tmp_path / "run"
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--node_rank=0",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"{ROOT}/train.py", "stage=1",
           f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", *FAST]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert f"the launch names 1 host that 127.0.0.1 cannot reach ({bad}: the name {bad} does not resolve" in out, \
        out[-3000:]
    assert f"Correct or remove {bad} in the hostfile" in out and "dist.check_hosts=false skips this check" in out
    assert time.time() - t0 < 120  # the join would have waited dist.timeout_minutes=120
    assert not (tmp_path / "cache").exists() and not (run / "stage1" / "metrics.jsonl").exists()


def test_the_host_check_tells_a_silent_host_from_one_that_answers():
    """A host that answers (even refusing the port) is up; one that never answers within the
    wait, or whose name does not resolve, is named with why. The silent host is a listening
    socket whose backlog is full, found at run time: connections to it are not answered."""
    import socket

    from msd_train.runtime import unreachable

    closed = free_port()  # nothing listens there: the connection is refused, so the host answered
    assert unreachable("127.0.0.1", closed, 2.0) is None
    assert "does not resolve" in unreachable("msd-node-that-does-not-exist.invalid", 22, 2.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    port = silent.getsockname()[1]
    fill = []
    try:
        for _ in range(4):  # fill the accept queue: later SYNs are dropped, as a dead host's would be
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fill.append(c)
        time.sleep(0.2)
        t0 = time.time()
        why = unreachable("127.0.0.1", port, 1.0)
        assert why == f"no answer from 127.0.0.1 port {port} within 1 s", why
        assert 0.9 < time.time() - t0 < 10
    finally:
        for c in fill:
            c.close()
        silent.close()
