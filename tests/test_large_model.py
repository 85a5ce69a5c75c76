"""bench/large_model.py's int8 row as a user runs it (``--dtype int8+bf16``): a tiny FedAvg round over a bf16
file, then over an int8 codes file (sources.BlockCodeFile through the round runner), one record with both rows,
their floors and the int8 / bf16 ratio; no file left behind."""

import json
import os
import sys

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_int8_and_bf16_rows_in_one_run(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "bench.large_model",
        "--d",
        "40000",
        "--K",
        "3",
        "--dir",
        str(work),
        "--dtype",
        "int8+bf16",
        "--out",
        str(tmp_path / "r.json"),
    ]
    r = cli_process.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert res["pair"] == "int8+bf16" and res["complete"]
    b, i = res["bf16"]["methods"][0], res["int8"]["methods"][0]
    assert b["method"] == i["method"] == "fedavg" and b["result_ok"] and i["result_ok"]
    assert b["bytes_read"] == 3 * 40000 * 2 and i["bytes_read"] == 3 * 40000 + 4 * 3 * -(-40000 // 256)
    assert res["int8_vs_bf16"] == b["time_s"] / i["time_s"]
    assert i["peak_rss_GB"] > 0 and res["int8"]["dd_s"] > 0 and "load average" in res["uptime_before"]
    if "floor_GBps" in res["int8"]["fio"]:  # (fio installed)
        assert i["vs_fio_floor"] == i["fio_floor_s"] / i["time_s"] and "vs_fio_floor" in b
    assert os.listdir(work) == []
