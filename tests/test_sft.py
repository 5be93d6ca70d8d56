"""rl/sft.py: packing several conversations into a row changes nothing about any of them (their
log-probs equal those of each alone), and the SFT loss is the mean NLL of the action tokens."""

import pytest
import torch

import envs
from rl.data import encode, to_record
from rl.logprobs import token_logprobs
from rl.batch import pack
from rl.model import load_model, load_tokenizer
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


def test_packed_log_probs_equal_each_conversation_alone(conversations):
    fmt, sequences = conversations
    model = load_model("tiny-agent").eval()
    longest = max(len(ids) for ids, _ in sequences)
    packed = pack(sequences, max_tokens=2 * longest, pad_id=fmt.pad_id)
    assert len(packed["rows"]) < len(sequences)  # some rows hold several conversations
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, packed["input_ids"], packed["attention_mask"], packed["loss_mask"],
                                     position_ids=packed["position_ids"])
        for r, members in enumerate(packed["rows"]):
            start = 0
            for i in members:
                ids, mask = sequences[i]
                assert packed["input_ids"][r, start:start + len(ids)].tolist() == ids
                trained = torch.tensor(mask, dtype=torch.float32)  # (other rows' action columns are scored too)
                assert torch.allclose(logprobs[r, start:start + len(ids)] * trained, alone(model, ids, mask), atol=1e-5)
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
