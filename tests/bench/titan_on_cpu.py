"""torchtitan's own training entry point on CPU, for tests and the CPU benchmarks: torchtitan 0.3.0 picks CUDA
whenever no other accelerator is found, so its device type is set to CPU and its device module replaced by the few
calls its Trainer makes (memory statistics read as zero). Everything else is the real Trainer and training loop.

    torchrun --nproc_per_node=1 tests/bench/titan_on_cpu.py --module bench.titan_llama --config torchpre_tiny ...
"""

import runpy
import sys
import types

import torch._utils

CPU = types.SimpleNamespace(
    set_device=lambda *args: None,
    synchronize=lambda *args: None,
    empty_cache=lambda: None,
    reset_peak_memory_stats=lambda *args: None,
    get_device_name=lambda *args: "cpu",
    get_device_properties=lambda *args: types.SimpleNamespace(total_memory=2**34),
    memory_stats=lambda *args: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                "num_alloc_retries": 0, "num_ooms": 0},  # fmt: skip
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: 0,
)

if __name__ == "__main__":
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: CPU
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__")
