"""What trains: the network kinds (--network_module), building and applying them, and the trainable parts of a run."""
