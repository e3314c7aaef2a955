"""The engine core: sequences, block accounting, the scheduler and its performance model (no devices, no data
movement: the executor carries out what the scheduler plans)."""
