"""A rollout server's weights group on one GPU, without vLLM (`python scripts/gpu_weight_broadcast.py`): the trainer's
side of the broadcast (rl/engines/server.py) from CUDA tensors in bf16, packed into buckets on the GPU, to a process on
the same GPU, which backend_to must reach over gloo (NCCL refuses two ranks on one device), received whole and equal.
Measured on an H100 (2026-11-26), when each tensor went alone (before the buckets): 51 tensors, 85.5 MiB in 0.25 s;
the buckets have not run on a GPU yet."""

import datetime
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.engines.server import backend_to, buckets, gpus, received, send_bucket, weight_group  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receiver(port, queue):
    torch.cuda.set_device(0)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    backend = backend_to({"device": "cuda", "gpus": gpus()})  # the trainer's view of a server on its GPU
    group = weight_group(store, 1, 2, backend, 60)
    device = "cpu" if backend == "gloo" else torch.device("cuda", 0)
    got = {name: tensor.to("cuda").float().sum().item() for name, tensor in received(group, device)}
    queue.put((backend, got))


def main():
    print("gpus:", gpus(), "torch", torch.__version__)
    info_same = {"device": "cuda", "gpus": gpus()}
    info_other = {"device": "cuda", "gpus": ["GPU-00000000-0000-0000-0000-000000000000"]}
    print("backend to a server on this GPU:", backend_to(info_same), "| on another GPU:", backend_to(info_other),
          "| on CPU:", backend_to({"device": "cpu"}))
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=2, intermediate_size=1536, vocab_size=32000)).cuda()
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
    queue = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=receiver, args=(port, queue))
    child.start()
    backend = backend_to(info_same)
    group = weight_group(store, 0, 2, backend, 60)
    device = "cpu" if backend == "gloo" else torch.device("cuda", 0)
    expected = {name: tensor.to(torch.bfloat16).float().sum().item() for name, tensor in model.state_dict().items()}
    start, sent, count = time.perf_counter(), 0, 0
    for table, bucket in buckets(iter(model.state_dict().items()), torch.bfloat16, 32 * 2**20, "cuda"):
        send_bucket(group, table, bucket, device)
        sent, count = sent + bucket.numel(), count + 1
    send_bucket(group, None, None, device)
    seconds = time.perf_counter() - start
    child_backend, got = queue.get(timeout=120)
    child.join()
    same = got.keys() == expected.keys() and all(got[k] == expected[k] for k in expected)
    print(f"backend {backend} (receiver {child_backend}); {len(got)} tensors in {count} buckets of 32 MiB at most, "
          f"{sent / 2**20:.1f} MiB bf16 from CUDA in "
          f"{seconds:.2f} s ({sent / 2**30 / seconds:.2f} GiB/s); received equal: {same}")
    assert same and backend == "gloo"


if __name__ == "__main__":
    main()
