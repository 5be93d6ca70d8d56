"""The run of scripts/bench.py: each section in a process of its own (so that its peak memory is its own), the
figures in one Markdown table (a section's rows come from its module) and one JSON file."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.asynchronous import async_rows, section_async
from bench.common import ROOT, SCRIPT, SECTIONS, Args
from bench.context import context_rows, section_context
from bench.bare import bare_rows, phase_bare
from bench.engine import engine_rows, phase_engine
from bench.env import env_rows, phase_env
from bench.rollout import phase_rollout, rollout_rows
from bench.server import phase_server, server_rows
from bench.update import phase_trl, section_update, trl_python, trl_rows, update_rows
from bench.weights import phase_weights, weights_rows


def run_phase(python: str, args: Args, phase: str, work: Path, run_dir: str | None = None) -> dict:
    """scripts/bench.py's --phase in a fresh process (its own memory peak), answering in a JSON file."""
    out = work / f"{phase}.json"
    flags = {**asdict(args), "phase": phase, "phase_out": str(out), "run_dir": run_dir}
    command = [python, str(SCRIPT)]
    for key, value in flags.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        command += [flag, *map(str, value)] if isinstance(value, tuple) else [flag + "=" + str(value)]
    quiet = {**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"}  # (TRL warns of vLLM versions it never uses here)
    done = subprocess.run(command, cwd=ROOT, env=quiet)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the {phase} section failed (exit {done.returncode}); its output is above")
    return json.loads(out.read_text())


def main(args: Args) -> None:
    from envs.latency import parse

    if args.phase is not None:
        phases = {"env": phase_env, "rollout": phase_rollout, "server": phase_server, "weights": phase_weights,
                  "trl": phase_trl, "engine": phase_engine, "bare": phase_bare}
        result = phases[args.phase](args)
        Path(args.phase_out).write_text(json.dumps(result, indent=2) + "\n")
        return
    try:
        parse(args.env_delay)  # (a bad spec stops here, not in the section that plays it)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    results: dict = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": args.model,
                     "seconds": {}}
    for section in args.sections:
        start = time.perf_counter()
        try:
            if section == "update" or (section in ("trl", "bare") and "update" not in results):
                results["update"] = section_update(args, work)
            if section == "async":
                results["async"] = section_async(args, work)
            if section == "context":
                results["context"] = section_context(args, work)
            if section in ("trl", "bare"):
                python = trl_python(args) if section == "trl" else sys.executable
                results[section] = run_phase(python, args, section, work, results["update"]["run_dir"])
            elif section not in ("update", "async", "context"):
                results[section] = run_phase(sys.executable, args, section, work)
        except Exception as error:  # one broken section (no vLLM, no network for TRL) costs only its rows
            results[section] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{section}: {results[section]['error']}", file=sys.stderr, flush=True)
        results["seconds"][section] = time.perf_counter() - start
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpus": os.cpu_count(), "cpu": cpu_name(), "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version(), "host": platform.node()}


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def table(results: dict) -> str:
    """The figures as a Markdown table: what was measured, the number, the target."""
    lines = [f"{results['date']}, {results['machine']['cpus']} x {results['machine']['cpu']}"
             + (f", {results['machine']['gpu']}" if results["machine"]["gpu"] else "") + f", model {results['model']}",
             "", "| section | figure | value | target |", "|---|---|---|---|"]
    lines += env_rows(results.get("env", {}))
    lines += rollout_rows(results.get("rollout", {}))
    lines += server_rows(results.get("server", {}), results["machine"]["cpus"])
    lines += weights_rows(results.get("weights", {}))
    lines += update_rows(results.get("update", {}))
    lines += trl_rows(results.get("trl", {}), results.get("update", {}))
    lines += async_rows(results.get("async", {}))
    lines += context_rows(results.get("context", {}))
    lines += engine_rows(results.get("engine", {}))
    lines += bare_rows(results.get("bare", {}), results.get("update", {}))
    for section in SECTIONS:
        if "error" in results.get(section, {}):
            lines.append(f"| {section} | failed | {results[section]['error'][:120]} | |")
    seconds = results.get("seconds") or {}
    if seconds:
        lines.append("| time | wall time of each section | " + ", ".join(f"{name} {s:,.0f} s" for name, s in seconds.items())
                     + f"; total {sum(seconds.values()):,.0f} s | default run <= 600 s |")
    return "\n".join(lines)
