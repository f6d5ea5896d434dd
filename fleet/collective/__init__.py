"""The collective engine: gradient buckets, compression and broadcasts over torch.distributed."""
