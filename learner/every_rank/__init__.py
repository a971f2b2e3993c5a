"""What every learner rank runs alike: the training step, its batch and losses, sharding, LoRA, and
the checkpoint files each rank writes and reads."""
