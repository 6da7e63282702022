"""Devices, ranks and collectives, atomic writes, dtype names: written once for every entry point.

Training, validation, feature generation and evaluation all run under the same launchers
(``python``, ``torchrun``, ``deepspeed``) on CPU or CUDA. What differs between those cases
lives here:

- ``pick_device`` / ``local_device``: ``auto`` -> ``cuda`` or ``cpu``; under a launcher each
  rank takes ``cuda:LOCAL_RANK`` and makes it current (NCCL and object collectives use the
  current device).
- ``setup_group``: join the launcher's process group (or make a one-process one for
  DeepSpeed), NCCL on CUDA, gloo on CPU, with a collective timeout of ``dist.timeout_minutes``
  (torch's and DeepSpeed's 10 minutes are shorter than rank 0 tokenising a large dataset).
- ``Group``: the collectives. A process group has a *communication device*: NCCL has only a
  CUDA backend, gloo is used here for CPU tensors. Every tensor handed to a collective is
  moved there first, so a CPU metric tensor never reaches NCCL (``RuntimeError: No backend
  type associated with device type cpu``) and a CUDA one never reaches gloo. Waits (barriers,
  rank 0 first) and object exchanges go through a gloo group beside an NCCL one: a rank
  waiting there blocks on the host instead of holding an NCCL collective open on its GPU,
  and pickled objects need no device staging.
- ``atomic_write_text`` / ``atomic_dir`` / ``atomic_file``: a crash leaves the old file or no
  file, never half of one.
- ``DTYPES`` / ``resolve_dtype``: the dtype names the configs accept.

Importable without deepspeed, hydra, omegaconf, wandb or datasets (the decoder side uses
it on GPU boxes that lack them): deepspeed is imported only inside ``setup_group``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and lossy)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# ----------------------------------------------------------------------------- devices
def pick_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_device(device: str = "auto") -> torch.device:
    """This rank's compute device. A bare ``cuda`` becomes ``cuda:LOCAL_RANK`` and is made
    current, so that each rank of a node has its own GPU."""
    dev = torch.device(pick_device(str(device)))
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank())
        torch.cuda.set_device(dev)
    return dev


# ----------------------------------------------------------------------------- groups
def free_port() -> int:
    """A TCP port nothing listens on now (for a launch the project starts itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process_store() -> str:
    """A ``file://`` rendezvous for a group of one process (``python train.py``).

    A port picked free and bound later can be taken in between (an outgoing connection of
    this or any other job gets the same ephemeral port), which failed launches under load;
    a file in the temporary folder cannot collide. The file is this process's own and is
    removed when it exits.
    """
    import atexit
    import tempfile

    fd, path = tempfile.mkstemp(prefix="msd-train-group-")
    os.close(fd)
    atexit.register(lambda: os.path.exists(path) and os.remove(path))
    return f"file://{path}"


def node_name() -> str:
    """This process's node: its host name and the launcher's node rank (``torchrun``:
    GROUP_RANK, ``deepspeed``: CROSS_RANK), which tells apart "nodes" sharing one machine."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', os.environ.get('CROSS_RANK', ''))}"


#: how gloo and the c10d store word a peer that is gone (its process or node killed, crashed, cut off)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Connection was likely closed", "Broken pipe")


def peer_gone(err: BaseException) -> bool:
    """Whether a collective failed because another rank of the job is gone. (NCCL notices it only
    at ``dist.timeout_minutes``, as a DistBackendError naming the timeout.)"""
    return isinstance(err, RuntimeError) and any(w in str(err) for w in PEER_GONE)


class JoinError(RuntimeError):
    """Not every process of the job met at the start (a node that never started its ranks)."""


class UnreachableHostError(JoinError):
    """A host the launcher names cannot be reached: its ranks could never start."""


class SharedPathError(RuntimeError):
    """A path that must be either shared by every node or local to each is neither."""


def folder_scope(views: dict[int, list[int]], n: int) -> str | None:
    """``views``: for each of ``n`` nodes, the nodes whose marker it sees in a folder.
    ``job``: one folder for all; ``node``: each node's own; None: some share it, others do not."""
    if all(v == list(range(n)) for v in views.values()):
        return "job"
    if all(v == [k] for k, v in views.items()):
        return "node"
    return None


def launcher_hosts() -> tuple[list[str], int] | None:
    """(the hosts of the job, this node's index among them) when DeepSpeed's multi-node
    launcher started this process (``deepspeed --hostfile``: pdsh runs
    ``deepspeed.launcher.launch --world_info=...`` on every host, this process's parent, and
    that argument lists the hosts); None under any other launcher."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    info = next((a.split("=", 1)[1] for a in args if a.startswith("--world_info=")), None)
    if "deepspeed.launcher.launch" not in args or info is None:
        return None
    try:
        hosts = list(json.loads(base64.urlsafe_b64decode(info)))
    except ValueError:
        return None
    return hosts, int(os.environ.get("CROSS_RANK", "0"))


def ssh_address(host: str) -> tuple[str, int]:
    """(address, port) that ``ssh host`` (and so pdsh) connects to: the user's ssh
    configuration (``ssh -G``: a ``Host`` alias, its ``HostName`` and ``Port``), else the name
    itself and port 22."""
    try:
        out = subprocess.run(["ssh", "-G", host], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return host, 22
    conf = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    try:
        return conf.get("hostname", host), int(conf.get("port", 22))
    except ValueError:
        return conf.get("hostname", host), 22


def unreachable(address: str, port: int, timeout: float) -> str | None:
    """Why ``address`` cannot be reached, or None: a name that does not resolve, or no answer
    to a TCP connection on ``port`` within ``timeout`` seconds (a host that refuses the
    connection answered, so it is up: the port it really listens on is not known here)."""
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the name {address} does not resolve ({e.strerror})"
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return None
    except TimeoutError:
        return f"no answer from {address} port {port} within {timeout:g} s"
    except OSError as e:
        return f"{address} port {port}: {e.strerror or e}"
    return None


#: seconds the pre-launch check waits for each host's answer
HOST_CHECK_SECONDS = 5.0


def check_launcher_hosts(timeout: datetime.timedelta, seconds: float = HOST_CHECK_SECONDS) -> None:
    """Before joining: every other host the launcher names (:func:`launcher_hosts`) must be
    reachable, all checked at once in ``seconds``; a host that is not would never start its
    ranks, and every other rank would wait for it for ``timeout``. Raises
    :class:`UnreachableHostError` naming the hosts and the fix. Every rank checks (a rank that
    skipped it would wait for the ranks that stop here)."""
    found = launcher_hosts()
    if found is None:
        return
    hosts, me = found
    others = [h for k, h in enumerate(hosts) if k != me]
    if not others:
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(32, len(others))) as pool:
        why = list(pool.map(lambda h: unreachable(*ssh_address(h), seconds), others))
    bad = [(h, w) for h, w in zip(others, why) if w]
    if not bad:
        return
    here = hosts[me] if me < len(hosts) else socket.gethostname()
    listed = "; ".join(f"{h}: {w}" for h, w in bad)
    raise UnreachableHostError(
        f"the launch names {len(bad)} host{'s' if len(bad) > 1 else ''} that {here} cannot reach ({listed}): "
        f"{'their' if len(bad) > 1 else 'its'} ranks would never start and the others would wait "
        f"dist.timeout_minutes={timeout.total_seconds() / 60:g} for them. Correct or remove "
        f"{', '.join(h for h, _ in bad)} in the hostfile (or start the machine, or fix the network or ssh "
        f"configuration: `ssh HOST true` must work from here), then launch again; nothing was written. "
        f"dist.check_hosts=false skips this check")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


#: minutes a collective may wait before the run fails (``dist.timeout_minutes`` in the configs):
#: long enough for rank 0 to tokenise LLaVA-665k + ShareGPT while the other ranks wait.
TIMEOUT_MINUTES = 120


def setup_group(device: torch.device, deepspeed: bool = False, timeout_minutes: float | None = None,
                check_hosts: bool = True) -> Group:
    """Join the process group the launcher prepared (``torchrun`` / ``deepspeed`` export
    RANK, WORLD_SIZE, MASTER_*).

    ``deepspeed=True`` (training) always makes a group, a one-process one under plain
    ``python``, because the engine needs one. Otherwise a single process gets no group and
    every collective is a no-op. ``timeout_minutes`` (default ``TIMEOUT_MINUTES``) bounds
    every collective's wait, the NCCL ones and the gloo waits alike. With ``check_hosts``
    (``dist.check_hosts``) every host a multi-node DeepSpeed launch names is checked first
    (:func:`check_launcher_hosts`).
    """
    import torch.distributed as dist

    backend = backend_for(device)
    timeout = datetime.timedelta(minutes=float(timeout_minutes or TIMEOUT_MINUTES))
    if check_hosts:
        check_launcher_hosts(timeout)
    try:
        return _join(dist, backend, timeout, deepspeed)
    except Exception as e:  # torch's DistStoreError: "Timed out after N seconds waiting for clients. 2/4 clients joined."
        if "waiting for clients" not in str(e):
            raise
        raise JoinError(
            f"not every process of the job joined within dist.timeout_minutes={timeout.total_seconds() / 60:g} "
            f"({str(e).strip().splitlines()[0][:160]}): a node never started its ranks. A host of the hostfile that "
            f"ssh cannot reach (deepspeed checks only the first; pdsh names the others in its output), a node whose "
            f"launcher failed or was not started, or another --nnodes, --master_addr or --master_port there. Check "
            f"`ssh HOST true` for every host and each node's launcher output, then launch again (nothing was "
            f"written); a lower dist.timeout_minutes finds this out sooner") from e


def _join(dist, backend: str, timeout: datetime.timedelta, deepspeed: bool) -> Group:
    if deepspeed:
        import deepspeed as ds

        if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
            # no launcher (or only an earlier launcher-less run in this process): a group of one,
            # met through a file rather than a port
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(local_rank()))
            ds.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                                init_method=_one_process_store(), rank=0, world_size=1)
        else:
            ds.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return Group(dist if dist.is_available() and dist.is_initialized() else None, timeout=timeout)


class Group:
    """The collectives of this project, with their inputs on the communication device.

    ``dist`` is ``torch.distributed`` (or None: one process, no group, every call a no-op).
    ``comm_device`` defaults to what the group's backend can carry: the current CUDA
    device for NCCL, the CPU for gloo. Tensor results come back on the communication
    device; callers read them once (``.tolist()``) where they need host numbers.
    ``waits`` is the gloo group for barriers and objects: the default group when that is
    gloo already, else a gloo group over the same ranks (made here, so every rank must
    construct its ``Group`` at the same point, as ``setup_group`` does).
    """

    def __init__(self, dist=None, comm_device: torch.device | str | None = None,
                 timeout: datetime.timedelta | None = None):
        self.dist = dist
        self.rank = dist.get_rank() if dist else 0
        self.world = dist.get_world_size() if dist else 1
        self.local_rank = local_rank() if dist else 0
        backend = str(dist.get_backend()).lower() if dist else "gloo"
        if comm_device is None:
            comm_device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self.comm_device = torch.device(comm_device)
        self.waits = None
        if backend != "gloo":
            self.waits = dist.new_group(backend="gloo", timeout=timeout or datetime.timedelta(minutes=TIMEOUT_MINUTES))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. Returns a tensor on the communication device (the input itself
        when it is already there, reduced in place)."""
        t = tensor.to(self.comm_device)
        if self.dist is not None:
            self.dist.all_reduce(t)
        return t

    def any(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank when any rank's flag is true (one host read)."""
        t = flag.float().reshape(1) if isinstance(flag, torch.Tensor) else torch.tensor([1.0 if flag else 0.0])
        return bool(self.all_reduce(t).item() > 0)

    def barrier(self) -> None:
        """Wait for every rank, on the host (the gloo group)."""
        if self.dist is not None:
            self.dist.barrier(group=self.waits)

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank (pickled over the gloo group)."""
        if self.dist is None:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.waits, device=torch.device("cpu"))
        return box[0]

    def gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (over the gloo group)."""
        if self.dist is None:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.waits)
        return out

    @contextlib.contextmanager
    def first(self, leads: bool):
        """The ranks with ``leads`` run the body first (they fill a cache, in parallel), the
        others after them (they read it)."""
        if not leads:
            self.barrier()
        yield
        if leads:
            self.barrier()

    def rank0_first(self):
        """Rank 0 runs the body first (it fills a cache), the other ranks after it (they read it)."""
        return self.first(self.main)

    def nodes(self) -> tuple[int, int, bool]:
        """(this rank's node index, number of nodes, whether it is its node's first rank).
        A node is a host and, where one machine holds several (tests), the launcher's node
        rank; its first rank is its lowest global rank, whatever LOCAL_RANK says."""
        if self.dist is None:
            return 0, 1, True
        if not hasattr(self, "_nodes"):
            names = self.gather_object(node_name())
            order = sorted(set(names))
            me = names[self.rank]
            self._nodes = order.index(me), len(order), names.index(me) == self.rank
        return self._nodes

    def cache_first(self, folder: str | Path | None, name: str):
        """Who fills a cache ``folder`` before the others read it (``first``): rank 0 when every
        node shares the folder (or there is none: each rank builds in memory, rank 0 first as
        ever), each node's first rank, in parallel, when each node has its own. Rank 0 says which,
        once; ``name`` is the setting (``data.cache_dir``), for that line and for the refusal of
        a folder some nodes share and others do not (``shared_by_all_nodes``)."""
        _, n, node_first = self.nodes()
        shared = not folder or self.shared_by_all_nodes(folder, name)
        if self.main and n > 1 and folder:
            logging.getLogger("msd_train").info(
                "%s %s is %s: the data is prepared once %s", name, folder,
                f"shared by the {n} nodes" if shared else "each node's own",
                "for the job, by rank 0" if shared else f"per node ({n} nodes), by each node's first rank")
        return self.first(self.main if shared else node_first)

    def shared_by_all_nodes(self, folder: str | Path, name: str) -> bool:
        """Whether ``folder`` is one folder for the whole job (True) or each node's own (False).

        Each node's first rank writes a marker named by a token of this launch (drawn by rank
        0, so a marker left by a killed launch never counts) and its node index; after a
        barrier each looks up every node's marker *by name* (an exact lookup, not a cached
        listing: NFS's close-to-open rule makes a file closed before the barrier visible to an
        open after it), then removes its own. Every node seeing every marker: one shared folder;
        each seeing only its own: node-local. Anything else (nodes 0 and 1 share it, node 2 has
        its own) cannot be prepared safely either way and is refused on every rank, naming the
        nodes: ``SharedPathError``. ``name`` is the setting, for the message.
        """
        node, n, first = self.nodes()
        if n == 1:
            return True
        import uuid

        token = self.broadcast_object(uuid.uuid4().hex if self.main else None)
        folder = Path(folder)
        marker = folder / f".msd-node-{token}-{node}"
        if first:
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(node_name() + "\n")
        self.barrier()
        seen = [k for k in range(n) if (folder / f".msd-node-{token}-{k}").exists()] if first else None
        views = {v[0]: v[1] for v in self.gather_object((node, seen) if first else None) if v is not None}
        if first:
            marker.unlink(missing_ok=True)
        scope = folder_scope(views, n)
        if scope is None:
            groups = sorted({tuple(v) for v in views.values()})
            raise SharedPathError(
                f"{name}={folder} is one folder for some nodes and another for others (nodes that see the same "
                f"folder: {', '.join('{' + ', '.join(map(str, g)) + '}' for g in groups)}): set it to a path on storage every "
                f"node shares, or to a path on each node's own disk (e.g. under /tmp or $TMPDIR)")
        return scope == "job"

    def destroy(self, barrier: bool = True) -> None:
        """Leave the group; ``barrier=False`` on error paths, where another rank may never arrive."""
        if self.dist is not None and self.dist.is_initialized():
            if barrier:
                self.barrier()
            self.dist.destroy_process_group()
            # DeepSpeed keeps a clone of the world group it made for an engine; it died with the
            # group, and the next engine in this process (stage 1 then stage 2 from a notebook,
            # training after generate_features in one script) would broadcast over it. Forget it.
            groups = sys.modules.get("deepspeed.utils.groups")
            if getattr(groups, "_WORLD_GROUP", None) is not None:
                groups._WORLD_GROUP = None


# ----------------------------------------------------------------------------- atomic writes
def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(path: str | Path, fsync: bool = False, keep_suffix: bool = False):
    """Yield a temporary path beside ``path``; renamed over it when the body returns.

    ``keep_suffix``: ``NAME.tmp.png`` rather than ``NAME.png.tmp``, for writers that pick
    the format from the extension (matplotlib).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}" if keep_suffix else f"{path.name}.tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync(tmp)
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str, fsync: bool = False) -> None:
    with atomic_file(path, fsync=fsync) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def replace_dir(tmp: str | Path, final: str | Path) -> None:
    """Move a finished folder into place, over an older one of that name."""
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def make_readable(folder: str | Path) -> None:
    """Give the files of an output folder the mode the user's umask gives any new file
    (0644 under the usual 022): safetensors' writer creates them 0600, so a head exported
    on a shared machine would otherwise be unreadable to the rest of the group."""
    mask = os.umask(0)
    os.umask(mask)
    for p in Path(folder).rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o666 & ~mask)


def atomic_dir(out: str | Path, write: Callable[[Path], None], locked: bool = False) -> None:
    """``write(tmp)`` into ``.tmp-NAME`` beside ``out``, then rename it over ``out``; its
    files get the usual mode (``make_readable``). A ``.tmp-NAME`` already there is removed
    only when a killed writer left it (``leftovers.make_staging``; ``locked``: the caller holds
    the lock of the folder ``out`` is in, as training holds its run's); when ``out`` is itself
    another writer's staging folder, its marker stays with what replaces it."""
    from msd_train import leftovers

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}"
    staged = leftovers.marker(out) is not None if out.is_dir() and not out.is_symlink() else False
    leftovers.make_staging(tmp, out, locked)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not staged:
        leftovers.unmark(tmp)
    make_readable(tmp)
    replace_dir(tmp, out)
