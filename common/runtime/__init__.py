"""Where and how code runs: devices and precision, DDP ranks and sharding, interrupts, phases, the Dask engine."""
