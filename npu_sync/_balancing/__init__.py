"""Balancing: how a worker is chosen and how many tasks it gets.

* :mod:`~npu_sync._balancing.selector`: :class:`Selector`, the façade the pool talks
  to; it owns each worker's slot and builds the strategy once per configuration;
* :mod:`~npu_sync._balancing.index`: per tier, the workers with room, and whether
  waiting for one can help (:mod:`~npu_sync._balancing.slot`: a worker's slot);
* the strategies, one small class each: :mod:`~npu_sync._balancing.least_loaded`
  (with power of two choices), :mod:`~npu_sync._balancing.round_robin`,
  :mod:`~npu_sync._balancing.weighted`, :mod:`~npu_sync._balancing.priority`;
* what they share: :mod:`~npu_sync._balancing.scores`,
  :mod:`~npu_sync._balancing.slowstart`, :mod:`~npu_sync._balancing.hold`, and
  least-loaded's rules in :mod:`~npu_sync._balancing.rules`;
* :mod:`~npu_sync._balancing.limits`: how many tasks a worker may have in flight.

Nothing is imported here: ``import npu_sync._balancing.selector`` where it is needed.
"""
