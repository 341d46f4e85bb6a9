"""Drafter training (``tandem train-drafter``): ``data`` (prompt files, the target's answers,
batches), ``config`` (settings, schedule), ``loss`` (DeepSpec's training forward and loss),
``trainer`` (model, optimizer, checkpoints, report) and ``pipeline`` (the stages)."""
