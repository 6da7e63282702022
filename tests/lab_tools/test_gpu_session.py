"""lab/gpu/session.py: the planner (which parts, in which order, what fits a budget, where a
running part is stopped), the carried wheels' check, what comes back, and one real run's watchdog."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from lab.gpu import session as gs
from msd_train import leftovers

ROOT = Path(__file__).resolve().parents[2]
GPU = {p: gs.PARTS[p].gpu_s for p in gs.PARTS}
CPU = {p: gs.PARTS[p].cpu_s for p in gs.PARTS}


# ----- which parts ------------------------------------------------------------------------------


def test_the_main_call_and_the_extra_call_are_the_documented_parts_in_order():
    assert gs.choose_parts([], local=False) == ["setup", "readme", "decode", "train"]
    assert gs.choose_parts(["extra"], local=False) == ["setup", "decode_13b", "decode_qwen2vl", "train_mb"]
    assert gs.choose_parts(["throughput"], local=False) == ["setup", "train"]  # train's old name


def test_a_rerun_of_one_part_installs_the_wheels_first_except_on_this_machine():
    assert gs.choose_parts(["decode"], local=False) == ["setup", "decode"]
    assert gs.choose_parts(["decode"], local=True) == ["decode"]
    assert gs.choose_parts(["setup", "setup"], local=False) == ["setup", "setup"]


def test_an_unknown_part_is_refused_with_the_parts_named():
    with pytest.raises(gs.PlanError, match=r"unknown part 'decod' \(parts: setup readme decode train"):
        gs.choose_parts(["decod"], local=False)


# ----- what fits the budget ---------------------------------------------------------------------


@pytest.mark.parametrize("est", [GPU, CPU], ids=["gpu", "local"])
def test_the_default_plans_fit_the_default_budget(est):
    """The one call as planned: every part of both calls starts and none is cut by the budget."""
    for parts in (gs.MAIN, gs.EXTRA):
        steps = gs.simulate(list(parts), est, budget_s=8 * 60)
        assert all(d.start for d, _ in steps), steps
        assert sum(took for _, took in steps) <= 8 * 60


def test_a_running_part_gets_its_estimate_plus_half_at_least_the_slack_never_past_the_budget():
    assert gs.share(120, left=480) == 180
    assert gs.share(40, left=480) == 70            # half is 20: the 30 s slack instead
    assert gs.share(40, left=480, min_slack=0) == 60
    assert gs.share(300, left=320) == 320          # never past what is left


def test_a_part_whose_estimate_does_not_fit_is_skipped_and_the_next_still_runs():
    est = {**GPU, "decode": 8 * 60}
    steps = gs.simulate(list(gs.MAIN), est, budget_s=8 * 60)
    started = [d.part for d, _ in steps if d.start]
    assert started == ["setup", "readme", "train"]
    skip = next(d for d, _ in steps if not d.start)
    assert skip.part == "decode" and skip.at == GPU["setup"] + GPU["readme"]


def test_an_overrunning_part_is_cut_at_its_share_and_costs_the_parts_that_no_longer_fit():
    """A hung readme is stopped at its share; what is left of the budget decides the rest."""
    steps = gs.simulate(list(gs.MAIN), GPU, budget_s=8 * 60, took={"readme": 3000})
    readme = next((d, t) for d, t in steps if d.part == "readme")
    assert readme[1] == readme[0].share == GPU["readme"] + GPU["readme"] // 2
    elapsed = GPU["setup"] + readme[1]
    for d, took in steps[2:]:
        assert d.at == elapsed and d.start == (elapsed + GPU[d.part] <= 8 * 60)
        elapsed += took
    assert [d.part for d, _ in steps if not d.start] == ["train"]


def test_the_budget_is_an_argument_not_a_constant():
    """Another lending arrangement: 4 minutes take setup and readme only; 12 take all, extra too."""
    short = gs.simulate(list(gs.MAIN), GPU, budget_s=4 * 60)
    assert [d.part for d, _ in short if d.start] == ["setup", "readme"]
    long = gs.simulate([*gs.MAIN, *gs.EXTRA[1:]], GPU, budget_s=12 * 60)
    assert [d.part for d, _ in long if d.start] == ["setup", "readme", "decode", "train", "decode_13b"]


def test_the_plan_lists_each_part_and_ends_with_the_total_rounded_up_to_a_tenth():
    lines = gs.plan_lines(["setup", "decode"], {"setup": 40, "decode": 121}, budget_min=8, local=False)
    assert lines[0].startswith("budget: 8 min (480 s)")
    assert re.match(r"^  setup\s+0:40  install", lines[2]) and re.match(r"^  decode\s+2:01  decoder table", lines[3])
    assert lines[-1] == "total: 2.7 min (budget 8 min)"  # 161 s = 2.68 min, up to 2.7
    assert gs.total_line(["setup"], {"setup": 60}, 2.5) == "total: 1 min (budget 2.5 min)"


# ----- the dry run as typed ---------------------------------------------------------------------


def _dry(capsys, *args):
    rc = gs.main(["run", "--dry-run", *args])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("local", [False, True])
def test_the_dry_run_prints_the_plan_and_the_commands_in_order_and_writes_nothing(tmp_path, capsys, local):
    out = tmp_path / "out"
    rc, text = _dry(capsys, "--wheels", str(tmp_path), "--out", str(out), *(["--local"] if local else []))
    assert rc == 0
    lines = text.strip().splitlines()
    assert lines[0].endswith("(dry run)") and lines[-1] == f"total: {7.7 if local else 8} min (budget 8 min)"
    starts = [line.split("== ")[1].split()[0] for line in lines if "] == " in line]
    assert starts == ["setup", "readme", "decode", "train"] and "SKIP" not in text
    order = ["deepspeed train.py stage=1", "deepspeed train.py stage=2", "python eval.py", "setsid deepspeed",
             "python -m lab.bench.decoder_table", "python -m lab.targets.make_large_target", "python -m lab.bench.train"]
    at = [text.index("+ " + cmd) for cmd in order]
    assert at == sorted(at)
    assert f"--device {'cpu' if local else 'cuda'}" in text
    bench_train = next(line for line in lines if line.startswith("+ python -m lab.bench.train"))
    assert bench_train.split("--micro-batches ")[1].split()[0] == ("1" if local else "2")
    assert not out.exists()


def test_the_dry_run_follows_the_arguments(tmp_path, capsys):
    rc, text = _dry(capsys, "extra", "--wheels", str(tmp_path), "--budget-min", "10", "--estimate", "decode_13b=200",
                    "--train-mb-sizes", "2,8")
    assert rc == 0 and text.strip().splitlines()[-1] == "total: 8.9 min (budget 10 min)"  # 40+200+120+170 s
    assert "--config llava15_13b" in text and "--config qwen2vl_7b" in text and "--config llava15_7b" not in text
    assert "--micro-batches 2,8" in text and "micro-batches 2,8" in text
    rc, text = _dry(capsys, "--wheels", str(tmp_path), "--dry-took", "readme=3000")
    assert "(the dry run's clock: readme takes 50:00, TIMEOUT at its share of 4:07)" in text
    assert re.search(r"^\[6:47\] SKIP train: its estimate 2:30 is over the 1:13 left of the budget$", text, re.M)


def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    assert gs.main(["run", "decod", "--dry-run"]) == 2
    assert "unknown part 'decod'" in capsys.readouterr().err
    for bad in (["--budget-min", "0"], ["--estimate", "nope=3"], ["--max-files", "-1"]):
        with pytest.raises(SystemExit) as e:
            gs.main(["run", "--dry-run", *bad])
        assert e.value.code == 2


# ----- the carried wheels -----------------------------------------------------------------------


def _wheels(folder: Path, sizes: dict[str, float]) -> Path:
    folder.mkdir(exist_ok=True)
    for name, mib in sizes.items():
        with open(folder / name, "wb") as f:
            f.truncate(int(mib * 2**20))  # sparse: the size counts, not the disk
    return folder


def test_the_check_names_the_biggest_wheels_when_over_the_carry_limit(tmp_path):
    w = _wheels(tmp_path / "w", {"big_pkg-1.0-py3-none-any.whl": 3, "small_pkg-1.0-py3-none-any.whl": 0.5})
    ok, lines = gs.check_wheels(w, carry_limit_mib=4, tree=int(1 * 2**20), specs=())
    text = "\n".join(lines)
    assert not ok and "TOO BIG: 4.5 MiB would travel, over the 4 MiB limit" in text
    assert text.index("big_pkg") < text.index("small_pkg") and "--no-wandb" in text
    ok, lines = gs.check_wheels(w, carry_limit_mib=64, tree=int(1 * 2**20), specs=())
    assert ok and "together 4.5 MiB of the 64 MiB a session may send" in lines[0]


def test_the_check_names_the_pinned_wheels_that_are_missing(tmp_path):
    w = _wheels(tmp_path / "w", {"hjson-3.1.0-py3-none-any.whl": 0.001})
    ok, lines = gs.check_wheels(w, carry_limit_mib=64, tree=0)
    assert not ok and "missing wheel: deepspeed==0.19.8" in lines and "missing wheel: hjson==3.1.0" not in lines
    assert lines[-1] == "run 'python -m lab.gpu.session pack' first (here, with network)"


# ----- what comes back --------------------------------------------------------------------------


def test_more_files_or_bigger_ones_than_a_call_brings_back_are_warned_about(tmp_path):
    _wheels(tmp_path, {"a.tar.gz": 0.5, "b.tar.gz": 2, "c.txt": 0})
    assert gs.out_warnings(tmp_path, max_files=8, file_limit_mib=16) == []
    assert gs.out_warnings(tmp_path, max_files=2, file_limit_mib=1) == [
        "warning: b.tar.gz is over 1 MiB and will not come back",
        f"warning: 3 files under {tmp_path}; a device call brings back 2"]


def test_unpack_puts_what_came_back_under_the_destination_by_gpu_name(tmp_path, capsys):
    back, work = tmp_path / "back", tmp_path / "w"
    back.mkdir()
    for part, names in (("decode", ["decode-llava15_7b-h100.json", "decode-llava15_7b-h100.md", "log.txt"]),
                        ("readme", ["resume.json", "report.json", "log.txt"])):
        (work / part).mkdir(parents=True)
        for n in names:
            (work / part / n).write_text("{}")
        with tarfile.open(back / f"{part}.tar.gz", "w:gz") as t:
            t.add(work / part, arcname=part)
    (back / "summary.json").write_text(json.dumps({"gpu": "h100", "parts": []}))
    (back / "env.txt").write_text("NVIDIA H100 80GB HBM3\n")
    dest = tmp_path / "bench"
    assert gs.unpack(back, dest, tmpdir=tmp_path) == 0
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["decode-llava15_7b-h100.json", "decode-llava15_7b-h100.md", "readme-h100/log.txt",
                   "readme-h100/report.json", "readme-h100/resume.json", "session-h100-env.txt",
                   "session-h100-summary.json"]
    assert f"then: git add {dest}" in capsys.readouterr().out
    assert not list(tmp_path.glob("gpu-unpack.*"))


def test_unpack_of_nothing_is_an_error_and_a_killed_unpacks_folder_is_removed(tmp_path, capsys):
    dest, tmpdir = tmp_path / "bench", tmp_path / "tmp"
    tmpdir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmpdir / f"gpu-unpack.{int(dead.stdout)}.abcdef"
    (killed / "decode").mkdir(parents=True)  # as an unpack killed with pid `dead` leaves it: marked
    (killed / leftovers.MARKER).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    users = tmpdir / f"gpu-unpack.{int(dead.stdout)}.mine"
    users.mkdir()  # named like one, not made by one
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for src, phrase in ((tmp_path / "missing", "no such folder, or nothing in it"),
                        (tmp_path / "empty", "no such folder, or nothing in it"),
                        (tmp_path / "other", "no results in it")):
        assert gs.unpack(src, dest, tmpdir=tmpdir) == 1
        out = capsys.readouterr()
        assert f"error: unpack {src}: {phrase}" in out.err and "git commit" not in out.out
    assert not killed.exists() and list(tmpdir.iterdir()) == [users]


def _came_back(back: Path, gpu="h100") -> Path:
    """A folder as a device call brings it back: one part's tar and the session's summary."""
    work = back.parent / f"w-{back.name}"
    (work / "decode").mkdir(parents=True)
    (work / "decode" / "decode-x-h100.json").write_text("{}")
    back.mkdir()
    with tarfile.open(back / "decode.tar.gz", "w:gz") as t:
        t.add(work / "decode", arcname="decode")
    (back / "summary.json").write_text(json.dumps({"gpu": gpu, "parts": []}))
    return back


def _refused(capsys, back, dest, *phrases):
    assert gs.unpack(back, dest, tmpdir=back.parent) == 1
    out = capsys.readouterr()
    assert f"error: unpack {back}: " in out.err and "nothing was copied" in out.err, out.err
    assert "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1, out.err
    for p in phrases:
        assert p in out.err, out.err
    assert not dest.exists() or not any(dest.rglob("*")), "something was copied"


def test_unpack_writes_only_under_dest_and_copies_no_link(tmp_path, capsys):
    """summary.json's "gpu" made folder names ("x/../../esc" wrote outside --dest), an env.txt that
    is a link was copied by content, a tar member with '..' was a traceback."""
    dest = tmp_path / "a" / "bench"
    back = _came_back(tmp_path / "b1", gpu="x/../../esc")
    _refused(capsys, back, dest, "'x/../../esc'", "summary.json")
    assert not list(tmp_path.rglob("*esc*"))

    back = _came_back(tmp_path / "b2")
    secret = tmp_path / "secret.txt"
    secret.write_text("a file of this machine")
    (back / "env.txt").symlink_to(secret)
    _refused(capsys, back, dest, "env.txt is a link")

    for name, member in (("dotdot", "../../esc.json"), ("absolute", "/tmp/esc.json"), ("link", "decode/l")):
        back = _came_back(tmp_path / f"b-{name}")
        with tarfile.open(back / "evil.tar.gz", "w:gz") as t:
            info = tarfile.TarInfo(member)
            if name == "link":
                info.type, info.linkname = tarfile.SYMTYPE, str(secret)
                t.addfile(info)
            else:
                info.size = 2
                t.addfile(info, io.BytesIO(b"{}"))
        _refused(capsys, back, dest, "evil.tar.gz holds", repr(member))
    assert not (tmp_path / "esc.json").exists()


# ----- a real run -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_run_stops_a_part_at_its_share_and_goes_on(tmp_path):
    """The watchdog, not the dry run's clock: each part killed at a 1 s share (its whole process
    group), recorded, and the session goes on to the next; summary.json and the log come back."""
    out = tmp_path / "out"
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "lab.gpu.session", "run", "setup", "setup", "--local",
                        "--estimate", "setup=1", "--min-slack", "0", "--out", str(out), "--work", str(tmp_path / "w")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.time() - t0 < 30
    assert r.returncode != 0, r.stdout + r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert [(p["part"], p["status"]) for p in s["parts"]] == [("setup", "timeout")] * 2
    assert all(p["seconds"] <= 5 for p in s["parts"]) and s["budget_s"] == 480
    assert "TIMEOUT: part setup" in (out / "session.log").read_text()
    assert len(list(out.iterdir())) <= 8
