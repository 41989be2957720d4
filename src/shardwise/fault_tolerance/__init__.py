# Fault tolerance across replica groups on torchft: the transform, its engine, joining, healing.
"""``fault_tolerant()``: survive a lost replica group (``pip install 'shardwise[ft]'``).

torchft itself is imported only when the transform is applied.
"""

from shardwise.fault_tolerance.transform import FaultTolerant, fault_tolerant

__all__ = ["FaultTolerant", "fault_tolerant"]
