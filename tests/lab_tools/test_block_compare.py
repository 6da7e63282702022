"""The block-drafting comparison's table (lab/studies/real_lm/block_compare.py) from its summary."""

from pathlib import Path

import pytest

from lab.studies.real_lm.block_compare import main, table


def _summary():
    val = {"val/text/sim_tau": 1.8, "val/mm/sim_tau": 1.7, "val/text/agree_cond_1": 0.5, "val/mm/agree_cond_1": 0.45}
    decode = {"text": {"tau": 1.9, "speedup": 1.25, "outputs_match_ar": True,
                       "accept_at_pos": [0.5, 0.25, 0.125, 0.1]},
              "images": {"tau": 1.8, "speedup": 1.2, "outputs_match_ar": False, "accept_at_pos": [0.4]}}
    return {"dflash-s0": {"head": "dflash", "seed": 0, "stage1_seconds": 130.0, "stage1_step_seconds": 100.0, "stage1": {}},
            "dflash-s0-on": {"head": "dflash", "seed": 0, "decouple_visual": True, "stage2_seconds": 70.0,
                             "stage2_step_seconds": 50.0,
                             "stage2": val, "decode": decode},
            "dflash-s0-off": {"head": "dflash", "seed": 0, "decouple_visual": False}}  # still training


def test_one_row_per_stage2_arm_with_both_stages_step_seconds_and_exactness_over_both_benches():
    rows = table(_summary()).splitlines()
    assert len(rows) == 4  # header, rule, two arms; the stage-1 entry is no row
    on = next(r for r in rows if "decoupled" in r)
    assert on == ("| dflash | 0 | decoupled | 1.800 | 1.700 | 0.500 | 0.450 | 150 | 1.900 | 0.50 0.25 0.12 | 1.25x "
                  "| 1.800 | 0.40 | 1.20x | no | - |")  # images did not match plain decoding: the arm is not exact
    off = next(r for r in rows if "shared" in r)
    assert off == "| dflash | 0 | shared | - | - | - | - | - | - | - | - | - | - | - | - | - |"


def test_each_row_names_the_cpus_it_trained_and_decoded_on_and_the_legend_names_them(tmp_path):
    """Step seconds and speedups hold on their machine: an arm trained on one CPU and decoded on
    another names both; a summary written before decodes recorded their CPU reads it from the reports."""
    import json

    a = "AMD EPYC (family 25, model 17, stepping 1; AVX-512 BF16, AVX-512, AVX2)"
    b = "Intel(R) Xeon(R) Processor (family 6, model 207, stepping 2; AMX BF16, AVX-512 BF16, AVX-512, AVX2)"
    summary = _summary()
    summary["dflash-s0"]["trained_on"] = [a]
    for bench in ("text", "images"):
        summary["dflash-s0-on"]["decode"][bench]["devices"] = [f"cpu ({b}, 2 threads)"]
    summary["dflash-s0-off"]["decode"] = {"text": {"tau": 1.5, "speedup": 1.1, "outputs_match_ar": True}}
    (tmp_path / "decode" / "dflash-s0-off-text-r2").mkdir(parents=True)
    (tmp_path / "decode" / "dflash-s0-off-text-r2" / "report.json").write_text(
        json.dumps({"device": f"cpu ({a}, 1 thread)"}))
    lines = table(summary, tmp_path).splitlines()
    assert next(r for r in lines if "decoupled" in r).endswith("| no | AMD EPYC 25/17, Intel Xeon 6/207 |")  # trained, decoded
    assert next(r for r in lines if "shared" in r).endswith("| yes | AMD EPYC 25/17 |")  # from its report
    assert lines[-2:] == [f"- AMD EPYC 25/17: {a}", f"- Intel Xeon 6/207: {b}"]


def test_table_without_a_summary_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="no .*summary.json yet; run the comparison first"):
        main([str(tmp_path), str(tmp_path / "out"), "--table"])


def test_a_stopped_launch_still_counts_its_seconds(tmp_path, monkeypatch):
    """A SIGTERMed train.py saves a checkpoint and exits 1; the relaunch resumes it, so the
    stage's training seconds must include the stopped launch's, saved before the comparison stops."""
    import lab.studies.real_lm.block_compare as bc

    codes = iter([1, 0])
    monkeypatch.setattr(bc.subprocess, "call", lambda *a, **kw: next(codes))
    entry, saved = {}, []
    with pytest.raises(SystemExit, match="stopped \\(1\\).*The same command resumes it"):
        bc.launch(["stage=1"], tmp_path / "log", entry, "stage1_seconds", lambda: saved.append(dict(entry)))
    first = entry["stage1_seconds"]
    here = bc.cpu_identity()
    assert saved == [{"trained_on": [here], "stage1_seconds": first}] and first >= 0  # and where it trained
    bc.launch(["stage=1"], tmp_path / "log", entry, "stage1_seconds", lambda: saved.append(dict(entry)))
    assert len(saved) == 2 and entry["stage1_seconds"] >= first


def test_copy_writes_no_path_of_this_machine_and_refuses_one_it_cannot_name(tmp_path):
    """What the repository keeps: the summary and the decode reports, WORK and OUT written so."""
    import json

    work, out, dest = tmp_path / "work", tmp_path / "work" / "blocks", tmp_path / "dest"
    summary = _summary()
    summary["dflash-s0-on"]["head_dir"] = "runs/dflash-s0-on/stage2/final"
    (out / "decode" / "dflash-s0-on-text").mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps(summary))
    report = {"command": f"python eval.py draft={out}/runs/dflash-s0-on/stage2/final bench.path={work}/splits/t.jsonl",
              "overall": {"tau": 1.9}}
    (out / "decode" / "dflash-s0-on-text" / "report.json").write_text(json.dumps(report))
    for arm, finished in (("dflash-s0-on", True), ("dflash-s0-off", False)):
        (out / "runs" / arm / "stage2" / "final").mkdir(parents=True)
        (out / "runs" / arm / "stage2" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
        if finished:
            (out / "runs" / arm / "stage2" / "final" / "config.json").write_text("{}")
    main([str(work), str(out), "--copy", str(dest)])
    import gzip

    assert gzip.decompress((dest / "metrics" / "dflash-s0-on" / "stage2" / "metrics.jsonl.gz").read_bytes()) == \
        b'{"step": 0, "loss": 1.0}\n'
    assert not (dest / "metrics" / "dflash-s0-off").exists()  # still training: not copied yet
    copied = json.loads((dest / "decode" / "dflash-s0-on-text" / "report.json").read_text())
    assert copied["command"] == "python eval.py draft=OUT/runs/dflash-s0-on/stage2/final bench.path=WORK/splits/t.jsonl"
    assert json.loads((dest / "summary.json").read_text()) == summary

    report["command"] += " target=/elsewhere/target"
    (out / "decode" / "dflash-s0-on-text" / "report.json").write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="left after the rewrite: .*/elsewhere/target"):
        main([str(work), str(out), "--copy", str(tmp_path / "dest2")])
    assert not (tmp_path / "dest2").exists()  # nothing written


def test_step_seconds_count_each_step_once_across_a_resume(tmp_path):
    """A launch stopped after logging steps past its last checkpoint logs them again when resumed."""
    import json

    from lab.studies.real_lm.block_compare import step_seconds

    rows = [{"step": 0, "val/sim_tau": 1.0}, {"step": 0, "tokens": 100.0, "tokens_per_s": 50.0},
            {"step": 1, "tokens": 90.0, "tokens_per_s": 30.0},  # stopped here; checkpoint at step 1
            {"step": 1, "tokens": 90.0, "tokens_per_s": 45.0}, {"step": 2, "tokens": 10.0, "tokens_per_s": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert step_seconds(tmp_path) == 2.0 + 2.0 + 1.0


def test_msd3_arms_need_a_store_of_layer_inputs_and_name_the_command_that_makes_it(tmp_path):
    work = tmp_path / "work"
    (work / "store").mkdir(parents=True)
    (work / "store" / "manifest.json").write_text("{}")  # the msd store: not enough for msd3
    with pytest.raises(SystemExit, match=r"no feature store in .*store-msd3 for the msd3 arms; make it first "
                                         r"\(python scripts/generate_features.py .*'features.layers=\[2,15,27\]'"):
        main([str(work), str(tmp_path / "out"), "--heads", "dflash", "msd3"])
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_visual_on_launches_only_the_decoupled_arm_and_msd3_reads_its_own_store(tmp_path, monkeypatch):
    """The equal-CPU-time arm trains one visual path; msd3's launches name its store and vocabulary."""
    import json

    import lab.studies.real_lm.block_compare as bc

    work, out, launches = tmp_path / "work", tmp_path / "out", []
    for store in ("store", "store-msd3"):
        (work / store).mkdir(parents=True)
        (work / store / "manifest.json").write_text("{}")

    def train(cmd, **kw):  # a finished stage: its final head and a validation row
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        launches.append(args)
        stage = Path(args["run_dir"]) / f"stage{args['stage']}"
        (stage / "final").mkdir(parents=True)
        (stage / "final" / "config.json").write_text("{}")
        (stage / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/sim_tau": 1.5}) + "\n")
        return 0

    monkeypatch.setattr(bc.subprocess, "call", train)
    main([str(work), str(out), "--heads", "msd3", "--seeds", "0", "--visual", "on"])
    assert [(Path(a["run_dir"]).name, a["stage"]) for a in launches] == [("msd3-s0", "1"), ("msd3-s0-on", "2")]
    assert all(a["features.path"] == f"{work}/store-msd3" and a["draft.draft_vocab_size"] == "8192"
               and a["draft.train_vocab"] == "null" for a in launches)
    assert launches[1]["draft.decouple_visual"] == "true"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"msd3-s0", "msd3-s0-on"} and summary["msd3-s0-on"]["stage2"]["val/sim_tau"] == 1.5


def test_repeated_decodes_give_the_median_speedup_its_range_and_exactness_over_every_run(tmp_path, monkeypatch):
    """One decode run carries +-5% of noise: --repeats N runs each bench N times (finished runs are kept)."""
    import json

    import lab.studies.real_lm.block_compare as bc

    speedups, ran = iter([1.3, 1.5, 1.4, 1.2, 1.1, 1.25]), []

    def eval_py(cmd, **kw):
        out = Path(next(a for a in cmd if a.startswith("out=")).split("=", 1)[1])
        ran.append(out.name)
        out.mkdir(parents=True)
        exact = out.name != "arm-images-r3"  # one run of one bench differs from plain decoding
        (out / "report.json").write_text(json.dumps({"device": f"cpu (X{len(ran) % 2}, 2 threads)", "overall": {
            "tau": 1.6, "accept_at_pos": [0.4], "speedup": next(speedups), "outputs_match_ar": exact}}))
        return 0

    monkeypatch.setattr(bc.subprocess, "call", eval_py)
    first = bc.decode(tmp_path, tmp_path, "arm", "dflash", tmp_path / "head", repeats=1)
    assert first["text"]["speedup"] == 1.3 and first["text"]["speedups"] == [1.3]
    d = bc.decode(tmp_path, tmp_path, "arm", "dflash", tmp_path / "head", repeats=3)
    assert ran == ["arm-text", "arm-images", "arm-text-r2", "arm-text-r3", "arm-images-r2", "arm-images-r3"]
    assert d["text"] == {"tau": 1.6, "accept_at_pos": [0.4], "speedup": 1.3, "speedups": [1.3, 1.4, 1.2],
                         "outputs_match_ar": True, "devices": ["cpu (X1, 2 threads)", "cpu (X1, 2 threads)",
                                                               "cpu (X0, 2 threads)"]}
    assert d["images"]["speedups"] == [1.5, 1.1, 1.25] and d["images"]["speedup"] == 1.25
    assert d["images"]["outputs_match_ar"] is False
    assert bc._speedup(d["text"]) == "1.30x (1.20-1.40)" and bc._speedup(first["text"]) == "1.30x"
