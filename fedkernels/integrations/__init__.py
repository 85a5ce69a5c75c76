"""Adapters to other federated-learning frameworks (optional extras).

* ``fedkernels.integrations.flower``: any fedkernels aggregator as a Flower strategy, for Flower's
  Message API (``FedKernelsMessageStrategy``, ``flwr.serverapp``, ``strategy.start(...)``) and its
  legacy API (``FedKernelsStrategy``, ``flwr.server.strategy``). Install from a checkout with
  ``pip install --no-build-isolation '.[flower]'``.

Submodules are imported on demand so that fedkernels itself never requires the frameworks.
"""
