"""A run directory's files: their layout and checked readers (`layout`), atomic writes and damage reports
(`files`), round checkpoints (`checkpoint`), the clients' private state (`store`) and the writer's lock
(`lock`)."""
