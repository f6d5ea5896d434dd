"""Data: each worker's shard of a DataLoader, of the job's files, and of CTR slot files."""
