"""`python -m rl.rollout_server ...`: the rollout server's command (the server itself is rl/engines/server.py)."""

from rl.engines.server import main

if __name__ == "__main__":
    main()
