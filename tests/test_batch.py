"""How a step's trajectories are laid out for the update (rl/batch.py) changes nothing it computes: micro-batches by
count or token budget, packed or padded, give the same log-probs, entropies, values, loss and gradients (packed:
under eager and SDPA attention; flash attention with several packed rows is refused); values move between the
padded batch and the micro-batches exactly."""

import random

import pytest
import torch
from accelerate import Accelerator

import train
from rl import optimizer as optimizer_lib
from rl.batch import arrange, attach, make_batch, scatter, to_full
from rl.logprobs import token_logprobs, token_values
from rl.model import build_models
from rollout import Trajectory


def trajectories(count: int = 7, seed: int = 0) -> list[Trajectory]:
    """Trajectories of different lengths: a prompt, then sampled turns between observations."""
    rng = random.Random(seed)
    out = []
    for row in range(count):
        traj = Trajectory("babyai", row, row // 2, row, messages=[], reward=float(row % 2))
        traj.add([rng.randrange(10, 500) for _ in range(rng.randrange(5, 30))])
        for _ in range(rng.randrange(1, 4)):
            turn = rng.randrange(2, 12)
            traj.add([rng.randrange(10, 500) for _ in range(turn)], [-1.0] * turn, trained=True)
            traj.add([rng.randrange(10, 500) for _ in range(rng.randrange(3, 9))])
        out.append(traj)
    return out


def test_layouts_respect_their_limits():
    lengths = [10, 50, 20, 30, 5, 45, 60]
    assert arrange(lengths, micro_batch_size=3) == [[[4], [0], [2]], [[3], [5], [1]], [[6]]]  # length-sorted
    for micro in arrange(lengths, token_budget=100):  # rows x the longest row
        assert len(micro) * max(lengths[row[0]] for row in micro) <= 100
    packed = arrange(lengths, token_budget=100, pack=True)
    assert sorted(i for micro in packed for row in micro for i in row) == list(range(7))
    assert all(len(micro) == 1 and sum(lengths[i] for i in micro[0]) <= 100 for micro in packed)
    assert len(packed) == 3  # 220 tokens in rows of 100, first fit from the longest
    assert arrange([120, 5], token_budget=100) == [[[1]], [[0]]]  # a trajectory over the budget goes alone
    assert len(arrange(lengths, token_budget=1000, pack=True, minimum=4)) == 4  # split until every optimizer step has one


def test_values_move_between_the_batch_and_its_micro_batches_exactly():
    played = trajectories()
    lengths = [len(t.token_ids) for t in played]
    for layout, pack in ((arrange(lengths, 2), False), (arrange(lengths, token_budget=64, pack=True), True)):
        batch = make_batch(played, 0, layout, "cpu", count=len(layout) + 1, pack=pack)
        assert len(batch.micro) == len(layout) + 1 and batch.micro[-1].loss_mask.sum() == 0  # an empty one
        assert batch.tokens == sum(lengths)
        values = torch.randn(batch.full.loss_mask.shape) * (batch.full.attention_mask > 0)
        attach(batch, values, values * 2)
        batch.full.advantages = None
        scatter(batch, ("advantages",))
        assert torch.equal(batch.full.advantages, values)
        for pieces, micro in zip(batch.pieces, batch.micro):
            for piece in pieces:
                row = micro.input_ids[piece.row, piece.offset:piece.offset + piece.length]
                assert row.tolist() == played[piece.trajectory].token_ids
                assert micro.returns[piece.row, piece.offset:piece.offset + piece.length].tolist() == \
                    (values[piece.trajectory, :piece.length] * 2).tolist()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_rows_score_each_trajectory_as_if_alone(attention):
    """Log-probs, entropies and the critic's values of packed rows equal those of padded rows, under each attention
    implementation (eager adds a mask to the scores, where a boolean one would add 0 or 1 and mask nothing)."""
    from rl.model import load_model, load_value_model

    model = load_model("tiny-agent", attn_implementation=attention).eval()
    critic = load_value_model("tiny-agent").eval()
    critic.set_attn_implementation(attention)
    played = trajectories()
    lengths = [len(t.token_ids) for t in played]
    padded = make_batch(played, 0, arrange(lengths, 7), "cpu")
    packed = make_batch(played, 0, arrange(lengths, token_budget=90, pack=True), "cpu", pack=True)
    assert len(packed.micro) > 1 and any(len(pieces) > 1 for pieces in packed.pieces)
    full = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        scored = {"scored": [], "entropy": [], "values": []}
        for micro in batch.micro:
            inputs = (micro.input_ids, micro.attention_mask, micro.loss_mask)
            with torch.no_grad():
                logprobs, entropy = token_logprobs(model, *inputs, with_entropy=True, position_ids=micro.position_ids)
                values = token_values(critic, *inputs, position_ids=micro.position_ids)
            for key, value in zip(scored, (logprobs, entropy, values)):
                scored[key].append(value)
        full[name] = {key: to_full(batch, values) for key, values in scored.items()}
    mask = padded.full.loss_mask > 0
    for key in ("scored", "entropy", "values"):
        torch.testing.assert_close(full["packed"][key][mask], full["padded"][key][mask], rtol=0, atol=1e-5,
                                   msg=lambda message, key=key: f"{attention}, {key}: {message}")


@pytest.mark.parametrize("attention, rows", [("flash_attention_2", 2), ("paged|eager", 1)])
def test_packing_refuses_attention_that_would_mix_sequences(attention, rows):
    """Flash attention finds packed sequences in a single row only; an implementation without transformers' masks
    would get no mask at all: packed rows then stop with a sentence instead of scoring across sequences."""
    from rl.model import load_model

    model = load_model("tiny-agent")
    model.config._attn_implementation = attention  # (set, not loaded: flash-attn needs a GPU)
    batch = make_batch(trajectories(4), 0, [[[0, 1], [2, 3]][:rows]], "cpu", pack=True).micro[0]  # two a row
    with pytest.raises(SystemExit, match="--micro-batch-size 1" if rows > 1 else "sdpa, eager"):
        token_logprobs(model, batch.input_ids, None, batch.loss_mask, position_ids=batch.position_ids)


def one_update(models, batch, args, accelerator) -> tuple[float, dict[str, torch.Tensor]]:
    """train.update on a prepared batch (one mini-batch): its summed policy loss, and the gradients its optimizer
    step saw, by parameter name."""
    gradients = {}
    original = optimizer_lib.optimizer_step

    def recording(model, *rest):
        gradients.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return original(model, *rest)

    optimizer_lib.optimizer_step = recording
    try:
        sums, _ = train.update(models, batch, args, accelerator, step=1)
    finally:
        optimizer_lib.optimizer_step = original
    return sums.policy, gradients


@pytest.mark.parametrize("aggregation,policy_loss", [
    ("token-mean", "ppo"), ("seq-mean-token-mean", "ppo"), ("seq-mean-token-sum", "ppo"),
    ("seq-mean-token-sum-norm", "ppo"), ("seq-mean-token-mean", "gspo"), ("token-mean", "cispo")])
def test_the_update_is_the_same_packed_or_padded(aggregation, policy_loss, tmp_path):
    """One GRPO optimizer step on the same trajectories: four padded micro-batches of 2, or packed rows of at most
    90 tokens: the same loss and the same gradient, for each --policy-loss, with pi_old moved off the policy (by
    each token's id, the same in either layout) so that the ratios are not 1 and gspo's are its sequences'."""
    accelerator = Accelerator(cpu=True)
    played = trajectories()
    gradients, losses = {}, {}
    for name, flags in (("padded", ["--micro-batch-size", "2"]),
                        ("packed", ["--max-tokens-per-micro-batch", "90", "--pack"])):
        args = train.parse_args(["--tasks-per-step", "4", "--n", "2", "--minibatches", "1", "--kl-coef", "0",
                                 "--loss-agg", aggregation, "--policy-loss", policy_loss, "--clip", "0.1",
                                 "--out-dir", str(tmp_path), *flags])
        torch.manual_seed(0)
        models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
        batch = train.batch_of(played, args, accelerator, 0)
        train.old_logprobs(models, batch, args, accelerator)
        for micro in batch.micro:
            current, _ = token_logprobs(models.policy, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                        position_ids=micro.position_ids)
            micro.old_logprobs = current.detach() + 0.15 * torch.sin(micro.input_ids.float()) * micro.loss_mask
        advantages, _ = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, None)
        attach(batch, advantages, None)
        losses[name], gradients[name] = one_update(models, batch, args, accelerator)
        accelerator.free_memory()
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-5)
    # (float noise: up to 1.2e-5 of a tensor's largest entry, measured on a Sapphire Rapids CPU where packed and padded
    # rows take different kernels; a row that saw another sequence's tokens is off by a good share of that entry)
    for name, gradient in gradients["padded"].items():
        torch.testing.assert_close(gradients["packed"][name], gradient, rtol=1e-3, atol=5e-5 * float(gradient.abs().max()),
                                   msg=lambda message, name=name: f"{name}: {message}")
