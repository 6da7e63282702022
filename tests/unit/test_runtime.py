"""msd_train.runtime: collectives reach the process group on its communication device."""

import datetime

import pytest
import torch

from msd_train import runtime


class FakeNCCL:
    """Stands in for torch.distributed over a backend that, like NCCL, carries tensors of
    one device type only (here ``meta``, the one non-CPU device every machine has)."""

    def __init__(self, device="meta", world=2):
        self.device, self.world, self.calls = torch.device(device), world, []

    def get_rank(self):
        return 0

    def get_world_size(self):
        return self.world

    def get_backend(self):
        return "fake"

    def is_initialized(self):
        return True

    def _check(self, name, t):
        self.calls.append((name, t.device.type))
        if t.device.type != self.device.type:
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")

    def all_reduce(self, t):
        self._check("all_reduce", t)

    def new_group(self, backend=None, timeout=None):
        self.calls.append(("new_group", backend, timeout))
        return f"{backend}-group"

    def broadcast_object_list(self, box, src=0, group=None, device=None):
        self.calls.append(("broadcast_object_list", group, torch.device(device).type))

    def all_gather_object(self, out, obj, group=None):
        self.calls.append(("all_gather_object", group))
        out[:] = [obj] * self.world

    def barrier(self, group=None, device_ids=None):
        self.calls.append(("barrier", group))


def test_collective_inputs_move_to_the_communication_device():
    fake = FakeNCCL()
    group = runtime.Group(fake, comm_device="meta")
    with pytest.raises(RuntimeError, match="device type cpu"):  # what NCCL does with a host tensor
        fake.all_reduce(torch.zeros(3))
    metrics = torch.zeros(5, dtype=torch.float64)  # a CPU tensor, as the step's metric sums were
    out = group.all_reduce(metrics)
    assert out.device.type == "meta" and out.dtype == torch.float64
    group.broadcast_object({"error": None})
    assert fake.calls[2:] == [("all_reduce", "meta"), ("broadcast_object_list", "gloo-group", "cpu")]


def test_comm_device_follows_the_backend():
    class Gloo(FakeNCCL):
        def get_backend(self):
            return "gloo"

    assert runtime.Group(Gloo("cpu")).comm_device == torch.device("cpu")
    assert runtime.Group(None).comm_device == torch.device("cpu")


def test_without_a_group_collectives_are_identity():
    g = runtime.Group(None)
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(g.all_reduce(t), t) and g.any(True) and not g.any(torch.tensor(False))
    assert g.broadcast_object("x") == "x" and g.gather_object(3) == [3]
    with g.rank0_first():
        pass
    assert (g.rank, g.world, g.main) == (0, 1, True)


def test_rank0_first_orders_the_barrier():
    fake = FakeNCCL("cpu")
    seen = []
    for rank in (0, 1):
        fake.get_rank = lambda rank=rank: rank
        g = runtime.Group(fake, comm_device="cpu")
        fake.calls.clear()
        with g.rank0_first():
            seen.append((rank, list(fake.calls)))
        seen.append((rank, list(fake.calls)))
    # rank 0 works before any barrier and waits after; rank 1 waits first
    wait = ("barrier", "gloo-group")
    assert seen == [(0, []), (0, [wait]), (1, [wait]), (1, [wait])]


def test_waits_and_object_exchanges_use_a_gloo_group_beside_nccl():
    """Rank 0 tokenising for an hour keeps the others in a host-side gloo wait with the run's
    timeout, not in an NCCL collective; metric tensors still go through the main group."""
    fake = FakeNCCL()
    timeout = datetime.timedelta(minutes=90)
    g = runtime.Group(fake, comm_device="meta", timeout=timeout)
    assert fake.calls == [("new_group", "gloo", timeout)]
    fake.calls.clear()
    with g.rank0_first():
        pass
    assert g.gather_object({"shard": 0}) == [{"shard": 0}] * 2
    g.broadcast_object("error")
    g.all_reduce(torch.zeros(2))
    assert fake.calls == [("barrier", "gloo-group"), ("all_gather_object", "gloo-group"),
                          ("broadcast_object_list", "gloo-group", "cpu"), ("all_reduce", "meta")]

    class Gloo(FakeNCCL):  # a gloo main group is used as is
        def get_backend(self):
            return "gloo"

    gloo = Gloo("cpu")
    runtime.Group(gloo).barrier()
    assert gloo.calls == [("barrier", None)]


def test_the_timeout_setting_reaches_the_process_group(monkeypatch):
    import deepspeed
    import torch.distributed as dist

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout=None: seen.update(torchrun=timeout))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(deepspeed=kw["timeout"]))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # as a launcher sets it (setup_group would otherwise write a one-rank env)
    runtime.setup_group(torch.device("cpu"), timeout_minutes=7)
    runtime.setup_group(torch.device("cpu"), deepspeed=True, timeout_minutes=7)
    assert seen == {"torchrun": datetime.timedelta(minutes=7), "deepspeed": datetime.timedelta(minutes=7)}
    runtime.setup_group(torch.device("cpu"))  # unset: the generous default, not torch's 10 minutes
    assert seen["torchrun"] == datetime.timedelta(minutes=runtime.TIMEOUT_MINUTES) > datetime.timedelta(minutes=60)


def test_atomic_writes_leave_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "report.json"
    runtime.atomic_write_text(path, "old")
    with pytest.raises(ZeroDivisionError):
        with runtime.atomic_file(path) as tmp:
            tmp.write_text("half")
            raise ZeroDivisionError("writer failed")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]

    out = tmp_path / "head"
    runtime.atomic_dir(out, lambda d: (d / "a").write_text("1"))
    with pytest.raises(OSError):
        runtime.atomic_dir(out, lambda d: (_ for _ in ()).throw(OSError("disk full")))
    assert (out / "a").read_text() == "1" and not (tmp_path / ".tmp-head").exists()


def test_dtype_names():
    assert runtime.resolve_dtype("auto", "cpu") == torch.float32
    assert runtime.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert runtime.resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        runtime.resolve_dtype("fp8", "cpu")


def test_nodes_are_told_apart_by_host_and_launcher_node_rank_and_led_by_their_lowest_rank(monkeypatch):
    fake = FakeNCCL("cpu", world=4)
    names = ["h/0", "h/0", "h/1", "h/1"]
    for rank, want in [(0, (0, 2, True)), (1, (0, 2, False)), (2, (1, 2, True)), (3, (1, 2, False))]:
        fake.get_rank = lambda rank=rank: rank
        g = runtime.Group(fake, comm_device="cpu")
        g.gather_object = lambda obj: names
        assert g.nodes() == want
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.delenv("CROSS_RANK", raising=False)
    assert runtime.node_name().endswith("/1")


def test_a_folder_is_the_jobs_or_each_nodes_or_refused():
    assert runtime.folder_scope({0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}, 3) == "job"
    assert runtime.folder_scope({0: [0], 1: [1], 2: [2]}, 3) == "node"
    assert runtime.folder_scope({0: [0, 1], 1: [0, 1], 2: [2]}, 3) is None  # nodes 0 and 1 share it, 2 does not


def test_a_peer_gone_is_told_from_other_failures():
    assert runtime.peer_gone(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5557. This is..."))
    assert not runtime.peer_gone(RuntimeError("CUDA out of memory"))
