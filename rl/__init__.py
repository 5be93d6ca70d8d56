"""The learning side: one idea per file.

    logprobs.py    trajectories -> padded tensors; per-token log-probs and entropy under a model
    advantages.py  outcome rewards -> per-token advantages (GRPO, ...)
    losses.py      PPO clipped policy loss, KL estimators, entropy, aggregation
    sft.py         supervised fine-tuning loss on trajectories (expert data, warm starts)
    model.py       which model: a Hugging Face id, a local path, or the embedded tiny agent
"""
