"""Our envs and the environment standards (OpenEnv, verifiers, Gym-style classes), in and out."""
