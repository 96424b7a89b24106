"""More than one process: data parallel, FSDP (FSDP1 and FSDP2 sharding) and DeepSpeed."""
