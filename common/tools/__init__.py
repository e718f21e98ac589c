"""Commands around the use cases: doctor, gpu-check, scaffold (new/export), scale benchmarks."""
