"""Run a script under Accelerate's FSDP2 on CPU processes (gloo), for tests on a machine without a GPU:

    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/fsdp2.yaml --num_processes 2 tests/cpu_fsdp.py SCRIPT [ARGS...]

(`--cpu` would make accelerate launch start one plain process; ACCELERATE_USE_CPU keeps its FSDP launcher.)

Accelerate 1.15 selects FSDP only among its GPU-like distributed types (AcceleratorState.__init__ sets it
for MULTI_GPU, MULTI_NPU, ... and never for MULTI_CPU), although PyTorch's fully_shard and everything
Accelerate does under FSDP2 (preparing, no_sync, clipping, gathering the state dict) run on CPU with gloo.
This launcher lifts that one gate, and nothing else, then runs SCRIPT as __main__.
"""

import os
import runpy
import sys

import accelerate.state as state
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

_init = state.AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        self.fsdp_plugin = fsdp_plugin or FullyShardedDataParallelPlugin()
        if self._mixed_precision != "no":  # (as Accelerate does for the GPU types: its FSDP2 precision policy)
            self.fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.distributed_type = DistributedType.FSDP
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


state.AcceleratorState.__init__ = _init_with_fsdp_on_cpu
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
