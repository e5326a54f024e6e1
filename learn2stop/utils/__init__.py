"""Infrastructure shared by every task: checkpoints, configs, registries, distributed context."""
