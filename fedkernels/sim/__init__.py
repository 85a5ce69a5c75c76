"""fedkernels.sim: the federated-learning simulator (data, partitions, models, training loop, CLI)."""
