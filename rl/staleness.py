"""The staleness rule of asynchronous training (train.py --max-staleness k), in one place: which policy version may
sample a step's episodes, which envs they play on, when they begin, and how old a trained token is. rollout.py's
Rollouts plays by it, rl/horizon.py decides `--horizon auto`'s cap by it, train.py sizes its envs by it and rl/batch.py
weighs tokens by their lag.

Set j is training step j's episodes, and step j trains exactly set j. Version v is the policy after v updates (the
engine has version j - 1 while step j's set is played synchronously). Set j's turns begin once the engine has version
`first_version(j, k)` = j - 1 - k, so at most k + 1 sets are under way, each on its own block of envs (`block`); a set
opens (its envs reset, its turn cap and seed are fixed) when the set k + 1 before it has been taken, freeing the block,
and at k = 0 once the update before it is done (`opens`).

The bound. Every turn is sampled by the version the engine has when it is generated, which is at least set j's first
version j - 1 - k, and set j trains at update j, whose weights are version j - 1: so a trained token lags
`lag(j, version)` = j - 1 - version <= k updates behind the weights it updates, whatever the envs' latencies, and no
episode is dropped. (A turn is generated whole by one version: the engine's weights change only while it holds
nothing.) At k = 0 every token is sampled by version j - 1 and the loop is the synchronous one, exactly: set j opens
after step j - 1 is over, as the synchronous loop begins step j.
"""


def first_version(j: int, k: int) -> int:
    """The oldest version that may sample set j's turns: they begin once the engine has it."""
    return j - 1 - k


def blocks(k: int) -> int:
    """The blocks of envs a loop of staleness k plays on: one per set under way."""
    return k + 1


def block(j: int, k: int) -> int:
    """The block of envs that set j plays on (the blocks taken in turn)."""
    return (j - 1) % blocks(k)


def opens(j: int, k: int, under_way: bool, version: int) -> bool:
    """Whether set j may open now: its block is free (set j - k - 1 is not `under_way`: taken, or never was), and at
    k = 0 the engine has its first version, i.e. the step before it is over, its metrics known (at k >= 1 its envs
    reset during the update before that, so that they are ready when the version comes)."""
    return not under_way and (k > 0 or version >= first_version(j, k))


def known_before(step: int, k: int) -> int:
    """The last step whose metrics are known when set `step` opens (and its --horizon auto cap is decided): the step
    before it at k = 0, as the synchronous loop; at k >= 1 the one before the step that took set step - k - 1, whose
    update was under way when the block came free."""
    return step - 1 if k == 0 else step - k - 2


def lag(step: int, version):
    """How many updates a token sampled by `version` is behind the weights that step `step` updates (at most k); `version`
    an int, or a tensor of each token's."""
    return step - 1 - version
