"""What ``mode="sharding"`` adds around FSDP2 so ordinary training code computes what one process would."""
