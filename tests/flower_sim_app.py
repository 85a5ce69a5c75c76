"""Runs FedKernelsMessageStrategy (SCAFFOLD, client payloads) under Flower's own simulation runtime
(`flwr.simulation.run_simulation`, Ray backend) and prints the final model as JSON. Used by
tests/test_flower.py in a subprocess (Ray starts worker processes and global state).

Usage: python tests/flower_sim_app.py SEED NUM_NODES ROUNDS"""

import json
import sys

import numpy as np

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedkernels import algorithms
from fedkernels.integrations.flower import FedKernelsMessageStrategy, unpack_payload
from test_flower import _arrays, _flat, _quad_client, _record

seed, num_nodes, rounds = (int(a) for a in sys.argv[1:4])
rng = np.random.default_rng(seed)
glob = _arrays(rng)
d = sum(a.size for a in glob)
targets = [rng.standard_normal(d) for _ in range(num_nodes)]  # client id -> its optimum

client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    keys = list(msg.content["arrays"].keys())
    arrays = [msg.content["arrays"][k].numpy() for k in keys]
    cid = int(msg.content["config"]["cid"])
    new, dc = _quad_client(arrays, unpack_payload(msg.content), targets[cid])
    return Message(
        RecordDict(
            {
                "arrays": _record(new),
                "metrics": MetricRecord({"num-examples": 10}),
                "fedkernels_payload": ArrayRecord({"delta_c": Array(dc)}),
            }
        ),
        reply_to=msg,
    )


server = ServerApp()
out = {}


@server.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedKernelsMessageStrategy(
        algorithms.build("scaffold"),
        num_clients=num_nodes,
        client_payloads=True,
        fraction_evaluate=0.0,
        min_train_nodes=num_nodes,
        min_available_nodes=num_nodes,
    )
    result = strategy.start(grid=grid, initial_arrays=_record(glob), num_rounds=rounds)
    out["final"] = _flat(result.arrays).tolist()
    out["rounds"] = sorted(result.train_metrics_clientapp)


run_simulation(
    server_app=server,
    client_app=client,
    num_supernodes=num_nodes,
    backend_config={
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": 2, "include_dashboard": False},
    },
)
print("RESULT " + json.dumps(out))
