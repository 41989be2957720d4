"""The Transformers Trainer on shardwise: the seam, its accelerator, its checkpoints."""
