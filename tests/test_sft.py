"""rl/sft.py: packing several conversations into a row changes nothing about any of them (their
log-probs, entropies and values equal those of each alone, under eager and SDPA attention), and the
SFT loss is the mean NLL of the action tokens."""

import pytest
import torch

import envs
from rl.data import encode, to_record
from rl.batch import pack
from rl.logprobs import token_logprobs, token_values
from rl.model import load_model, load_tokenizer, load_value_model
from rl.sft import sft_loss
from rollout import ChatFormat, ExpertEngine, rollout


@pytest.fixture(scope="module")
def conversations():
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    environments = [envs.make("babyai") for _ in range(5)]
    played = rollout(ExpertEngine(fmt, environments), fmt, environments, envs.splits("babyai")["train"][:5],
                     list(range(5)), horizon=3, max_new_tokens=256, max_tokens=4096)
    return fmt, [encode(fmt, to_record(t)) for t in played]


def alone(model, ids, mask):
    logprobs, _ = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                                 torch.tensor([mask], dtype=torch.float32))
    return logprobs[0]


# (eager attention over the packed rows of 2,366 tokens: about 15 s of CPU)
@pytest.mark.parametrize("attention", [pytest.param("eager", marks=pytest.mark.slow), "sdpa"])
def test_packed_rows_score_each_conversation_as_if_alone(conversations, attention):
    """Log-probs, entropies and a critic's values of packed rows equal those of each conversation alone, under
    each attention implementation."""
    fmt, sequences = conversations
    model = load_model("tiny-agent", attn_implementation=attention).eval()
    critic = load_value_model("tiny-agent").eval()
    critic.set_attn_implementation(attention)
    longest = max(len(ids) for ids, _ in sequences)
    packed = pack(sequences, max_tokens=2 * longest, pad_id=fmt.pad_id)
    assert len(packed["rows"]) < len(sequences)  # some rows hold several conversations

    def scores(input_ids, attention_mask, loss_mask, position_ids=None):
        logprobs, entropy = token_logprobs(model, input_ids, attention_mask, loss_mask, with_entropy=True,
                                           position_ids=position_ids)
        return {"log-probs": logprobs, "entropies": entropy,
                "values": token_values(critic, input_ids, attention_mask, loss_mask, position_ids)}

    with torch.no_grad():
        together = scores(packed["input_ids"], None, packed["loss_mask"], packed["position_ids"])
        for r, members in enumerate(packed["rows"]):
            start = 0
            for i in members:
                ids, mask = sequences[i]
                assert packed["input_ids"][r, start:start + len(ids)].tolist() == ids
                trained = torch.tensor(mask, dtype=torch.float32)  # (other rows' action columns are scored too)
                single = scores(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), trained[None])
                for key, expected in single.items():
                    in_row = together[key][r, start:start + len(ids)]
                    torch.testing.assert_close(in_row * trained, expected[0] * trained, rtol=0, atol=1e-5,
                                               msg=lambda m, key=key: f"{attention}, {key}: {m}")
                start += len(ids)


def test_sft_loss_is_the_mean_nll_of_action_tokens_packed_or_not(conversations):
    fmt, sequences = conversations
    model = load_model("tiny-agent").eval()
    with torch.no_grad():
        nll = torch.cat([-alone(model, ids, mask)[torch.tensor(mask) == 1] for ids, mask in sequences])
        packed = pack(sequences, max_tokens=4096, pad_id=fmt.pad_id)
        assert torch.allclose(sft_loss(model, packed), nll.mean(), atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        pack(sequences, max_tokens=10, pad_id=fmt.pad_id)
