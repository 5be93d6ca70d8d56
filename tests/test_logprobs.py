"""Scoring in chunks (rl/logprobs.py): the log-probs, entropies and gradients of the plain computation, without
ever holding more than a chunk of logits."""

import pytest
import torch

from rl.logprobs import token_logprobs
from rl.model import load_model


def plain(model, ids, mask, temperature):
    """The textbook computation: all logits, log-softmax, the target's entry."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float() / temperature
    logp = logits.log_softmax(-1)
    picked = torch.zeros(ids.shape)
    entropy = torch.zeros(ids.shape)
    picked[:, 1:] = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy[:, 1:] = -(logp.exp() * logp).sum(-1)
    columns = mask.any(0).float()
    return picked * columns, entropy * columns


@pytest.mark.parametrize("chunk_elements", [2**26, 5_000, 1])  # one chunk; ~9 positions a chunk; one position a chunk
def test_chunked_scoring_equals_the_plain_computation(chunk_elements):
    torch.manual_seed(0)
    model = load_model("tiny-agent")
    ids = torch.randint(3, 500, (3, 48))
    mask = torch.zeros(3, 48)
    mask[:, 12:30] = 1
    mask[1, 40:] = 1
    gradients = []
    for compute in ("chunked", "plain"):
        model.zero_grad()
        if compute == "chunked":
            logprobs, entropy = token_logprobs(model, ids, torch.ones_like(ids), mask, 0.7, with_entropy=True,
                                               chunk_elements=chunk_elements)
        else:
            logprobs, entropy = plain(model, ids, mask, 0.7)
        ((logprobs - 0.01 * entropy) * mask).sum().backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
        if compute == "chunked":
            chunked = (logprobs.detach(), entropy.detach())
    torch.testing.assert_close(chunked[0], logprobs.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(chunked[1], entropy.detach(), rtol=0, atol=2e-5)
    for name, gradient in gradients[1].items():
        torch.testing.assert_close(gradients[0][name], gradient, rtol=1e-4, atol=1e-5 * float(gradient.abs().max()))


def test_chunks_keep_no_logits_for_the_backward():
    """Scored whole, the backward pass keeps several copies of the [positions x vocab] logits (logits, softmax,
    log-softmax, ...); in chunks it keeps none (each chunk's are recomputed in the backward pass)."""
    model = load_model("tiny-agent")
    ids = torch.randint(3, 500, (2, 400))
    mask = torch.ones(2, 400)
    vocab = model.get_output_embeddings().out_features

    def saved_logits(chunk_elements):
        """Elements of the tensors saved for the backward that are vocabulary-wide (logits and what follows them)."""
        sizes = []

        def pack(tensor):
            if tensor.dim() and tensor.shape[-1] == vocab:
                sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            token_logprobs(model, ids, torch.ones_like(ids), mask, with_entropy=True, chunk_elements=chunk_elements)
        return sum(sizes)

    logits = 2 * 399 * vocab
    assert saved_logits(2**26) >= 4 * logits  # one chunk: measured 5 copies
    assert saved_logits(vocab * 16) == 0  # chunks of 16 positions


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_right_padded_rows_score_as_each_sequence_alone_without_a_mask(attention):
    """A right-padded batch is scored under the causal mask alone (rl/logprobs.forward_inputs: SDPA's fused kernel,
    no [B, 1, T, T] mask): every row's log-probs and entropies are those of its sequence scored alone, without padding;
    a left-padded batch keeps its mask, and so does flash attention (it unpads by it)."""
    from rl.logprobs import forward_inputs, pad

    torch.manual_seed(0)
    model = load_model("tiny-agent", attn_implementation=attention).eval()
    sequences = [(ids, [0] * 5 + [1] * (len(ids) - 5)) for ids in (torch.randint(3, 500, (n,)).tolist() for n in (40, 23, 9))]
    batch = pad(sequences, 0)
    assert forward_inputs(model, batch["input_ids"], batch["attention_mask"], None)["attention_mask"] is None
    left = batch["attention_mask"].flip(1)
    assert forward_inputs(model, batch["input_ids"], left, None)["attention_mask"] is left
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                           with_entropy=True)
        for row, (ids, mask) in enumerate(sequences):
            alone = pad([(ids, mask)], 0)
            own, own_entropy = token_logprobs(model, alone["input_ids"], alone["attention_mask"], alone["loss_mask"],
                                              with_entropy=True)
            n = len(ids)
            torch.testing.assert_close(logprobs[row, :n] * alone["loss_mask"][0], own[0] * alone["loss_mask"][0],
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy[row, :n] * alone["loss_mask"][0], own_entropy[0] * alone["loss_mask"][0],
                                       rtol=0, atol=1e-5)
    model.config._attn_implementation = "flash_attention_2"  # (set, not loaded: flash-attn needs a GPU)
    kept = forward_inputs(model, batch["input_ids"], batch["attention_mask"], None)["attention_mask"]
    assert kept is batch["attention_mask"]
