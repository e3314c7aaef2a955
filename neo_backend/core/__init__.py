"""The engine core: sequences, block accounting, the scheduler and its performance model (no torch devices, no data movement)."""
