"""The learning side: one idea per file.

    logprobs.py    trajectories -> padded tensors; per-token log-probs and entropy under a model
    advantages.py  outcome rewards -> per-token advantages (GRPO, ...)
    losses.py      PPO clipped policy loss, KL estimators, entropy, aggregation
    sft.py         supervised fine-tuning loss on trajectories (expert data, warm starts)
    horizon.py     ScalingInter-RL: the turn cap as a schedule over training steps
    model.py       which model: a Hugging Face id, a local path, or the embedded tiny agent
    memory.py      peak memory of a phase of a step (GPU allocated, else resident set)

Importing this package sets OpenMP's wait policy, so the entry scripts import it before torch.
"""

import os

# torch's OpenMP threads spin while they wait for work; on a shared or small CPU that starves the env
# threads and everything else (measured here: 0.3 s vs 3.5 ms per decode step of the tiny model).
# libgomp reads this once, when torch loads it: it must be set before the first `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
