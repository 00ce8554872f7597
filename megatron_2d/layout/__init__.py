"""Pure layout math (no torch): rank topology, masks as bands, per-step kernel calls, the ring schedule,
named setting choices, HybridModel patterns and Hybrid ZeRO bytes. The op and the planner share it."""
