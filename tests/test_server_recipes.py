"""scripts/recipes/rollout-server-*.sh: the split launches of issue 33 (rollout servers on GPUs of their own, FSDP2
training on the rest), run with stand-ins for `python -m rl.rollout_server`, the wait for its /info and `accelerate`
that record what they were given: the servers get their GPUs and tensor parallel size, training the other GPUs and
flags that parse and pass the start-up checks, the servers are stopped at the end; DRY_RUN=1 plans both parts."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "scripts" / "recipes"
SERVER_RECIPES = sorted(RECIPES.glob("rollout-server-*.sh"))

STAND_INS = {
    # a server records its pid, GPUs and flags, then serves until it is stopped; `python -c ... HOST:PORT` (the /info
    # check) answers at once for another host (node A's), on this one once the server of that port has started
    "python": f"""#!/bin/sh
if [ "$1" = -m ]; then
  echo "$$ $CUDA_VISIBLE_DEVICES $*" >> "$RECORD/servers"
  exec sleep "${{SERVE_S:-60}}"
fi
if [ "$1" = -c ]; then
  case $3 in 127.0.0.1:*) grep -q -- "--port ${{3##*:}} " "$RECORD/servers" 2>/dev/null || exit 1 ;; esac
  exit 0
fi
exec {sys.executable} "$@"
""",
    "accelerate": """#!/bin/sh
echo "$CUDA_VISIBLE_DEVICES" > "$RECORD/launch_gpus"
printf "%s\\n" "$@" > "$RECORD/launch"
""",
}


def run_recipe(tmp_path, recipe: str, *argv: str, **env: str) -> tuple[list[list[str]], list[str], str]:
    """The recipe with the stand-ins first on PATH: each server's [pid, GPUs, flags...], the launch's argv and GPUs
    (none where it did not launch)."""
    for name, text in STAND_INS.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RECORD": str(tmp_path), **env}
    subprocess.run(["bash", str(RECIPES / recipe), *argv], env=env, check=True, timeout=120)
    def lines(name):
        return (tmp_path / name).read_text().splitlines() if (tmp_path / name).exists() else []

    return [line.split() for line in lines("servers")], lines("launch"), "".join(lines("launch_gpus"))


def gone(pid: str) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # (each recipe starts its processes: ~5 s)
def test_one_node_serves_on_two_gpus_and_trains_fsdp2_on_six(tmp_path):
    servers, argv, gpus = run_recipe(tmp_path, "rollout-server-one-node.sh", "--save-every", "5")
    [[pid, server_gpus, *flags]] = servers
    assert server_gpus == "0,1" and flags[:2] == ["-m", "rl.rollout_server"]
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2" and "Qwen/Qwen2.5-7B-Instruct" in flags
    assert gone(pid)  # stopped when the script ended
    assert gpus == "2,3,4,5,6,7"
    assert argv[:6] == ["launch", "--config_file", "configs/fsdp2.yaml", "--num_processes", "6", "train.py"]
    args = train.parse_args(argv[6:])
    train.check(args, world=6, distributed="FSDP")
    assert args.engine_args.rollout_server == ("127.0.0.1:8900",) and args.engine_args.vllm_tensor_parallel_size == 2
    assert args.env == ("babyai",) and args.tasks_per_step == 18 and args.run_args.save_every == 5  # (the command line's last)
    assert args.model == "Qwen/Qwen2.5-7B-Instruct" and args.objective.kl_coef == 0.001  # the paper recipe's settings


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_two_nodes_serve_on_all_of_a_and_train_on_all_of_b(tmp_path, tp):
    servers, argv, _ = run_recipe(tmp_path, "rollout-server-two-nodes.sh", "serve", TP=str(tp), SERVE_S="1")
    assert argv == []  # (node A trains nothing)
    servers.sort(key=lambda s: s[s.index("--port") + 1])  # (in the order they wrote their records: any)
    assert [s[s.index("--port") + 1] for s in servers] == [str(8900 + i) for i in range(8 // tp)]
    assert [s[1] for s in servers] == [",".join(map(str, range(i, i + tp))) for i in range(0, 8, tp)]
    assert all(s[s.index("--tensor-parallel-size") + 1] == str(tp) and s[s.index("--host") + 1] == "0.0.0.0"
               for s in servers)
    (tmp_path / "servers").unlink()
    servers, argv, _ = run_recipe(tmp_path, "rollout-server-two-nodes.sh", "train", TP=str(tp), SERVER_HOST="10.0.0.2",
                                  RECIPE="textcraft_scalinginter-rl")
    assert servers == [] and argv[:6] == ["launch", "--config_file", "configs/fsdp2.yaml", "--num_processes", "8",
                                          "train.py"]
    args = train.parse_args(argv[6:])
    train.check(args, world=8, distributed="FSDP")
    assert args.engine_args.rollout_server == tuple(f"10.0.0.2:{8900 + i}" for i in range(8 // tp))
    assert args.engine_args.vllm_tensor_parallel_size == tp and args.env == ("textcraft",) and len(args.horizon) == 3


def test_two_nodes_need_node_a_named_and_tp_dividing_eight(tmp_path):
    for argv, env, message in ((["train"], {}, "SERVER_HOST"), (["serve"], {"TP": "3"}, "TP=3"),
                               (["both"], {}, "usage")):
        done = subprocess.run(["bash", str(RECIPES / "rollout-server-two-nodes.sh"), *argv], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=60)
        assert done.returncode == 1 and message in done.stderr, done.stderr


@pytest.mark.slow
def test_dry_run_plans_the_trainer_and_the_server_gpus(tmp_path):
    from test_memory_plan import qwen_7b

    done = subprocess.run(["bash", str(RECIPES / "rollout-server-one-node.sh")], capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", "MODEL": qwen_7b(tmp_path / "7b"), "HF_HUB_OFFLINE": "1"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fsdp2.yaml: FSDP over 6 processes" in done.stdout and "vllm engine" not in done.stdout
    assert "memory plan per rollout server GPU" in done.stdout
    assert "2 generate per rollout server x 1 server (8 GPUs in all)" in done.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_recipes_are_shellcheck_clean():
    done = subprocess.run(["shellcheck", "-x", *map(str, SERVER_RECIPES), str(RECIPES / "common.sh")],
                          capture_output=True, text=True, cwd=RECIPES)
    assert done.returncode == 0, done.stdout
