"""Byzantine-robust aggregation rules: each replaces FedAvg's mean of the K client updates with a
statistic that a minority of arbitrary (Byzantine) updates cannot drag far.

* ``median``, ``trimmed_mean`` (``coordinate.py``): per coordinate, the median / the mean without the
  ``int(beta K)`` smallest and largest values (Yin et al. 2018; Flower's FedMedian / FedTrimmedAvg).
* ``krum``, ``bulyan`` (``krum.py``): Krum / Multi-Krum (Blanchard et al. 2017) and Bulyan
  (El Mhamdi et al. 2018), scored on the K x K squared distances from the fp64 Gram matrix.
* ``geometric_median`` (``geomed.py``): RFA's smoothed Weiszfeld iterations (Pillutla et al. 2022).
* ``centered_clip`` (``centered_clip.py``): centred clipping around the previous aggregate
  (Karimireddy et al. 2021).

What they share (the selection pass over U with its screen, the bound checks, the row distances) is
``common.py``.
"""

from . import centered_clip, coordinate, geomed, krum  # noqa: F401  (each registers its methods)
