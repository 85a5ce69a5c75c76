"""LoRA fine-tuning from the real CLI (subprocess): a 2-round run per mode writes the adapters' bytes per round,
the mode's distances to the true average update and its mode and ranks in provenance.json; heterogeneous
ranks, a codec, and a resumed fold run bit for bit equal to an uninterrupted one; every bad lora input is one
line, exit 2, nothing written. The bounds: exact's factors are the best rank-r approximation of the true
average (Eckart-Young), so its error is at most naive's (whose product also has rank <= r), up to the fp32
rounding of the stored factors; fold's residual makes base + product the true average up to that rounding."""

import json
import os
import sys

import pytest
import torch

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["plots=false", "threads=1", "--no-progress", "rounds=2"]
U32 = 2.0**-24


def fk(*args, cwd, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def _prov(run_dir):
    with open(os.path.join(run_dir, "provenance.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("mode", ["naive", "exact", "fold"])
def test_each_mode_runs_two_rounds_and_reports_adapter_bytes_and_errors(tmp_path, mode):
    p = fk("run", "--preset", "smoke", *QUICK, "--name", "r", f"lora.mode={mode}", "lora.r=4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "r"
    lo = _prov(run)["lora"]
    assert lo["mode"] == mode and lo["r"] == 4 and "client_ranks" not in lo
    # smoke's MLP 64-32-10: rank-4 adapters on fc1 and fc2, nothing else trainable
    assert lo["layers"] == {
        "base_model.model.fc1": {"rank": 4, "fan_in": 64, "fan_out": 32},
        "base_model.model.fc2": {"rank": 4, "fan_in": 32, "fan_out": 10},
    }
    d = 4 * (64 + 32) + 4 * (32 + 10)
    assert lo["d_trainable"] == lo["d_adapters"] == d
    rows = _rows(run)
    assert len(rows) == 2
    for r in rows:
        assert r["bytes_sent"] == r["bytes_dense"] == 4 * d * 4  # 4 clients x d fp32 adapter entries
        assert r["agg"]["lora_mode"] == mode
    last = rows[-1]["agg"]
    naive, err, norm = last["naive_error_to_true_average"], last["error_to_true_average"], last["true_update_norm"]
    assert naive > 0 and norm > 0  # round 2: B != 0, the factor average is not the average
    if mode == "naive":
        assert err == naive
    elif mode == "exact":
        assert err <= naive + 64 * U32 * norm
    else:
        assert err <= 64 * U32 * norm < naive
    fm = torch.load(run / "final_model.pt", weights_only=True)
    assert fm["flat"].numel() == d


def test_heterogeneous_ranks_are_cycled_and_each_client_sends_its_rank(tmp_path):
    p = fk(
        "run",
        "--preset",
        "smoke",
        *QUICK,
        "--name",
        "h",
        "lora.mode=exact",
        "lora.r=4",
        "lora.ranks=[1,2,4]",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "h"
    assert _prov(run)["lora"]["client_ranks"] == [1, 2, 4, 1]
    per_rank = 64 + 32 + 32 + 10  # adapter entries per unit of rank
    for r in _rows(run):
        assert r["agg"]["client_ranks"] == [1, 2, 4, 1]
        assert r["bytes_sent"] == (1 + 2 + 4 + 1) * per_rank * 4
        assert r["bytes_dense"] == 4 * 4 * per_rank * 4


def test_exact_lora_with_a_codec_sends_the_codec_bytes(tmp_path):
    p = fk(
        "run",
        "--preset",
        "smoke",
        *QUICK,
        "--name",
        "c",
        "lora.mode=exact",
        "lora.r=4",
        "compress.kind=int8_block",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    d = 4 * (64 + 32 + 32 + 10)  # 552 entries: 3 blocks of 256 columns, one fp32 scale each
    for r in _rows(tmp_path / "runs" / "c"):
        assert r["agg"]["codec"].startswith("int8_block")
        assert r["bytes_sent"] == 4 * (d + 3 * 4) and r["bytes_dense"] == 4 * d * 4


def test_naive_lora_runs_any_method_on_the_adapters(tmp_path):
    p = fk(
        "run",
        "--preset",
        "smoke",
        *QUICK,
        "--name",
        "m",
        "lora.mode=naive",
        "lora.r=4",
        "algorithm.name=fedavgm",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "m"
    assert _prov(run)["lora"]["aggregation"] == "the method (fedavgm)"
    assert all(r["bytes_sent"] == 4 * 4 * (64 + 32 + 32 + 10) * 4 for r in _rows(run))


def test_fold_with_error_feedback_resumes_bit_for_bit(tmp_path):
    ov = [
        "lora.mode=fold",
        "lora.r=4",
        "compress.kind=topk",
        "compress.ratio=0.2",
        "compress.error_feedback=true",
        "checkpoint_every=1",
    ]
    full = fk("run", "--preset", "smoke", *QUICK, "--name", "full", *ov, cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    cut = fk("run", "--preset", "smoke", *QUICK[:-1], "rounds=1", "--name", "cut", *ov, cwd=tmp_path)
    assert cut.returncode == 0, cut.stderr[-3000:]
    res = fk("run", "--resume", "runs/cut", "rounds=2", "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(
        r["agg"]["codec"].startswith("topk") and r["bytes_sent"] < r["bytes_dense"]
        for r in _rows(tmp_path / "runs" / "cut")
    )
    a = torch.load(tmp_path / "runs" / "full" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "runs" / "cut" / "final_model.pt", weights_only=True)
    assert torch.equal(a["flat"], b["flat"])
    base = [k for k in a["state_dict"] if "base_layer.weight" in k]
    assert base and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])


@pytest.mark.parametrize(
    "ov,words",
    [
        (["lora.mode=exact", "lora.r=0"], ["lora.r", ">= 1", "0"]),
        (["lora.mode=exact", "lora.alpha=0"], ["lora.alpha", "> 0"]),
        (["lora.mode=sideways"], ["lora.mode", "naive|exact|fold", "sideways"]),
        (["lora.mode=exact", "lora.target_modules=[fc9]"], ["lora.target_modules", "fc9", "fc1, fc2"]),
        (["lora.mode=exact", "lora.r=4", "lora.ranks=[2,8]"], ["lora.ranks", "[1, lora.r=4]", "8"]),
        (["lora.mode=exact", "lora.ranks=[]"], ["lora.ranks", "non-empty"]),
        (["lora.ranks=[2]"], ["lora.ranks is set but lora.mode is null"]),
        (["lora.mode=exact", "algorithm.name=fedavgm"], ["lora.mode=exact", "algorithm.name=fedavg", "fedavgm"]),
        (["lora.mode=fold", "dp.kind=central", "dp.clip=1", "dp.noise_multiplier=1"], ["lora.mode=fold", "dp"]),
        (["lora.mode=fold", "workers=2"], ["lora.mode=fold", "workers=2"]),
        (["lora.mode=exact", "lora.ranks=[2,4]", "lora.r=4", "compress.kind=int8_block"], ["lora.ranks", "compress"]),
        (["lora.mode=exact", "lora.base=missing.pt"], ["lora.base", "missing.pt", "not found"]),
    ],
)
def test_bad_lora_input_is_one_line_exit_2_nothing_written(tmp_path, ov, words):
    p = fk("run", "--preset", "smoke", "plots=false", "--no-progress", *ov, cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_base_that_does_not_fit_the_model_is_one_line(tmp_path):
    torch.save({"fc1.weight": torch.zeros(3, 3)}, tmp_path / "base.pt")
    p = fk(
        "run", "--preset", "smoke", "plots=false", "--no-progress", "lora.mode=exact", "lora.base=base.pt", cwd=tmp_path
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "lora.base" in lines[0] and "does not fit" in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_without_peft_lora_says_how_to_install_it(tmp_path):
    fake = tmp_path / "nopeft" / "peft"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named peft')\n")
    env = {"PYTHONPATH": f"{tmp_path / 'nopeft'}{os.pathsep}{ROOT}"}
    p = fk("run", "--preset", "smoke", "plots=false", "--no-progress", "lora.mode=exact", cwd=tmp_path, env_extra=env)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install fedkernels[lora]" in lines[0], lines
    assert not (tmp_path / "runs").exists()


# ---- the library's Simulation with a caller's peft model (model_fn) ------------------------------------------
def _sim(tmp_path, model_fn, **lora):
    from fedkernels.sim import presets
    from fedkernels.sim.config import apply_overrides
    from fedkernels.sim.simulation import Simulation

    cfg = apply_overrides(
        presets.get("smoke"),
        ["plots=false", "threads=1", "rounds=1", f"out_dir={tmp_path}/runs"]
        + [f"lora.{k}={v}" for k, v in lora.items()],
    )
    return Simulation(cfg, model_fn=model_fn)


def _mlp():
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_a_peft_model_without_lora_layers_is_one_line_nothing_written(tmp_path):
    peft = pytest.importorskip("peft")

    def model_fn(num_classes, in_ch, size):  # a peft model of another kind (IA3): no LoRA layers
        return peft.get_peft_model(_mlp(), peft.IA3Config(target_modules=["1", "3"], feedforward_modules=["3"]))

    with pytest.raises(ValueError, match="no LoRA layers") as e:
        _sim(tmp_path, model_fn, mode="exact").run()
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_a_model_whose_rank_is_not_the_servers_is_one_line_nothing_written(tmp_path):
    peft = pytest.importorskip("peft")

    def model_fn(num_classes, in_ch, size):
        return peft.get_peft_model(_mlp(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["1", "3"]))

    with pytest.raises(ValueError, match=r"lora.r=8 but the model's LoRA layer .* has rank 2") as e:
        _sim(tmp_path, model_fn, mode="exact").run()
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_exact_lora_in_two_worker_processes_gives_the_bits_of_one(tmp_path):
    ov = ["lora.mode=exact", "lora.r=4"]
    one = fk("run", "--preset", "smoke", *QUICK, "--name", "one", *ov, cwd=tmp_path)
    two = fk("run", "--preset", "smoke", *QUICK, "--name", "two", *ov, "workers=2", cwd=tmp_path)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a = torch.load(tmp_path / "runs" / "one" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "runs" / "two" / "final_model.pt", weights_only=True)
    assert torch.equal(a["flat"], b["flat"])
