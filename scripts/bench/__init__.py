"""The sections of scripts/bench.py, a module each: env.py (in process vs over HTTP), rollout.py (HF vs vLLM),
server.py (in-process vLLM vs a rollout server), update.py (our update, and TRL's on the same batches),
asynchronous.py (the synchronous loop vs --max-staleness k); common.py holds the flags and the process helpers,
run.py the run of the sections and their table."""
