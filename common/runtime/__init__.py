"""Where and how code runs: devices and precision, distributed ranks and sharding, interrupts, memory, the Dask engine."""
