"""Pure layout math (standard library only, no torch): rank topology, masks as bands, per-step kernel calls, the
ring schedule, named setting choices, HybridModel patterns, Hybrid ZeRO bytes, and the rules the op and the planner
share (the head split, the transport kind, the default cost figures). The only op code the planner imports."""
