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
