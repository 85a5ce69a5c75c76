"""Per-round server learning-rate schedules (fedkernels.algorithms.server_lr) in FedAvg and FedAvgM."""

import json

import pytest
import torch
from torch.testing import assert_close

from fedkernels import algorithms
from fedkernels.algorithms.server_lr import ServerLRSchedule
from fedkernels.sim.cli import main


def _write(tmp_path, obj, name="sched.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def _rounds(K=3, d=11, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(K, d, generator=g, dtype=torch.float64), torch.randint(1, 50, (K,), generator=g).tolist())
        for _ in range(T)
    ]


def test_fedavg_schedule_scales_each_round_step_exactly(tmp_path):
    s = [0.5, 2.0, 0.0, 0.125]
    path = _write(tmp_path, {"server_lr": s, "note": "extra keys are ignored"})
    agg = algorithms.build("fedavg", server_lr=0.8, server_lr_schedule=path)
    x = torch.randn(11, dtype=torch.float64)
    for t, (U, n) in enumerate(_rounds(T=4)):
        new, info = agg.aggregate(x, U, n, client_ids=[0, 1, 2])
        p = torch.tensor(n, dtype=torch.float64) / sum(n)
        assert_close(new, x + 0.8 * s[t] * (p[:, None] * U).sum(0), rtol=0, atol=1e-14)
        assert info["server_lr"] == 0.8 * s[t]
        x = new
    with pytest.raises(ValueError, match=r"round 5 has no value; the schedule has 4 rounds"):
        agg.aggregate(x, U, n, client_ids=[0, 1, 2])


def test_fedavgm_schedule_scales_the_step_not_the_momentum(tmp_path):
    s = [1.0, 0.25, 3.0]
    path = _write(tmp_path, {"server_lr": s})
    for nesterov in (False, True):
        plain = algorithms.build("fedavgm", beta=0.7, nesterov=nesterov)
        sched = algorithms.build("fedavgm", beta=0.7, nesterov=nesterov, server_lr_schedule=path)
        x = torch.randn(11, dtype=torch.float64)
        for t, (U, n) in enumerate(_rounds(T=3, seed=1)):
            a, _ = plain.aggregate(x, U, n, client_ids=[3, 4, 5])
            b, info = sched.aggregate(x, U, n, client_ids=[3, 4, 5])
            assert torch.equal(plain.momentum, sched.momentum)  # the buffer evolves as without a schedule
            assert_close(b - x, s[t] * (a - x), rtol=0, atol=1e-14)
            assert info["server_lr"] == s[t] and info["beta"] == 0.7
            x = b  # both step from the same point each round


def test_recorded_runs_are_matched_by_sampled_clients(tmp_path):
    path = _write(
        tmp_path,
        {
            "runs": [
                {"seed": 0, "clients": [[0, 1], [2, 3], [0, 3]], "server_lr": [1.0, 0.5, 0.25]},
                {"seed": 1, "clients": [[2, 3], [0, 1], [1, 2]], "server_lr": [1.0, 0.1, 0.2]},
            ]
        },
    )
    sch = ServerLRSchedule.load(path)
    assert [sch.value(0, [3, 2]), sch.value(1, [1, 0]), sch.value(2, [2, 1])] == [1.0, 0.1, 0.2]
    sch = ServerLRSchedule.load(path)
    assert sch.value(0, [1, 0]) == 1.0
    with pytest.raises(
        ValueError,
        match=r"round 2 sampled clients \[0, 1\], but the recorded run \(runs\[0\]\) "
        r"had \[2, 3\]",
    ):
        sch.value(1, [0, 1])
    with pytest.raises(ValueError, match=r"round 1 sampled clients \[0, 2\], which no recorded run has"):
        ServerLRSchedule.load(path).value(0, [0, 2])
    # FedAvg: the excluded clients of a round count as sampled
    agg = algorithms.build("fedavg", server_lr_schedule=path, on_bad_update="exclude")
    U = torch.ones(2, 4, dtype=torch.float64)
    U[1, 0] = float("nan")
    new, info = agg.aggregate(torch.zeros(4, dtype=torch.float64), U, [1, 1], client_ids=[2, 3])
    assert info["server_lr"] == 1.0 and [e["client_id"] for e in info["excluded"]] == [3]
    new, info = agg.aggregate(new, torch.ones(2, 4, dtype=torch.float64), [1, 1], client_ids=[0, 1])
    assert info["server_lr"] == 0.1
    assert_close(new, torch.full((4,), 1.1, dtype=torch.float64))


@pytest.mark.parametrize(
    "content,msg",
    [
        (None, "cannot read the file"),
        ("{not json", "not valid JSON"),
        ({"server_lr": []}, "non-empty list of numbers"),
        ({"server_lr": [1.0, -0.5]}, r"server_lr\[1\] = -0.5; expected a finite number >= 0"),
        ('{"server_lr": [1.0, NaN]}', r"server_lr\[1\] = nan"),
        ({"server_lr": [1.0, True]}, r"server_lr\[1\] = True"),
        ({"server_lr": [1.0], "runs": []}, "either 'server_lr'"),
        ([1.0, 2.0], "either 'server_lr'"),
        ({"runs": [{"clients": [[0]], "server_lr": [1.0, 2.0]}]}, r"runs\[0\]: 'clients' must be a list of 2"),
        ({"runs": [{"clients": [[0], []], "server_lr": [1.0, 2.0]}]}, r"clients\[1\] = \[\]"),
        ({"runs": [{"server_lr": [1.0]}]}, "expected an object with 'clients' and 'server_lr'"),
    ],
)
def test_bad_schedule_files_name_the_problem(tmp_path, content, msg):
    path = str(tmp_path / "missing.json") if content is None else _write(tmp_path, content)
    with pytest.raises(ValueError, match=msg) as e:
        algorithms.build("fedavg", server_lr_schedule=path)
    assert str(e.value).startswith(f"fedavg: server_lr_schedule={path}")


@pytest.mark.parametrize("name", ["fednova", "fedprox"])
def test_methods_with_their_own_step_reject_a_schedule(tmp_path, name):
    path = _write(tmp_path, {"server_lr": [1.0]})
    with pytest.raises(ValueError, match=f"{name}: server_lr_schedule=.* is not supported"):
        algorithms.build(name, server_lr_schedule=path)


def test_cli_compare_replays_a_schedule(tmp_path, capsys, monkeypatch, one_thread):
    # a relative path: the method label (with its options) names the run directory, so no "/" in it
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cmp"
    _write(tmp_path, {"server_lr": [1.0, 0.0]})
    path = "sched.json"
    rc = main(
        [
            "compare",
            "--preset",
            "smoke",
            "--methods",
            f"fedavg,fedavg:server_lr_schedule={path}",
            "--seeds",
            "0",
            "--rounds",
            "2",
            "--out",
            str(out),
            "--quiet",
            "--no-progress",
        ]
    )
    assert rc == 0
    lab = f"fedavg:server_lr_schedule={path}"
    rows = [json.loads(l) for l in (out / f"{lab}-s0" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    plain = [json.loads(l) for l in (out / "fedavg-s0" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert [r["agg"]["server_lr"] for r in rows] == [1.0, 0.0] and "server_lr" not in plain[0]["agg"]
    assert rows[0]["accuracy"] == plain[0]["accuracy"]  # s_1 = 1: the plain FedAvg round
    assert rows[1]["accuracy"] == rows[0]["accuracy"]  # s_2 = 0: the model did not move
    # a bad file is an error before any run: exit 2, one line naming the option, the file and the problem
    _write(tmp_path, {"server_lr": [1.0, -1.0]}, "bad.json")
    bad = "bad.json"
    assert (
        main(
            [
                "compare",
                "--preset",
                "smoke",
                "--methods",
                f"fedavg:server_lr_schedule={bad}",
                "--rounds",
                "2",
                "--out",
                str(tmp_path / "bad"),
                "--quiet",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"server_lr_schedule={bad}: server_lr[1] = -1.0; expected a finite number >= 0" in err
    assert not (tmp_path / "bad").exists()
