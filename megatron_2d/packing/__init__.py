"""Packed documents (THD) as pure numpy: the packing modes (one class each, one registry), where each token goes
(document sharding), every context rank's ring view as runs, and the kernel calls between runs.
``megatron_2d.PackedSharding`` is the runtime object over it."""
