"""Adapters to other federated-learning frameworks (optional extras).

* ``fedkernels.integrations.flower``: ``FedKernelsStrategy``, any fedkernels aggregator as a Flower
  strategy (``pip install 'fedkernels[flower]'``).

Submodules are imported on demand so that fedkernels itself never requires the frameworks.
"""
