"""How K/V blocks reach the ranks that need them: the Transport contract, the Double-Ring, the neighbour
exchange, the local block, the op's table of them by kind, and the communication helpers (byte counter,
point-to-point exchanges)."""
