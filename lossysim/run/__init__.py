"""Running experiments: one training run (``experiment``), its checkpoints and tracking, and sweeps."""
