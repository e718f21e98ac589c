"""Fake a CPU without native BF16 for every Python process of a test run, subprocesses included: `make
test-no-bf16` puts this folder on PYTHONPATH (and ATEN_CPU_CAPABILITY=avx2 keeps torch off AVX-512 kernels), so the
suite can be checked as a machine without AVX-512 would run it."""
import importlib.abc
import importlib.util
import sys


class _NoBF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._is_avx512_bf16_supported = lambda: False
            module._is_amx_tile_supported = lambda: False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NoBF16())
