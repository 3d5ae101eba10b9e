"""training.loss_chunk_size on one process: the chunked output layer and cross-entropy against the whole logits.

A model whose output layer is a `ChunkedOutput` (the same weights) gives the full-logits loss, every parameter's
gradient, the validation loss and the multiple-choice log-likelihoods of the same model, for chunk sizes that divide
its tokens, that do not, and that exceed them; with ignored labels (IGNORE_INDEX, as the multi-token prediction's
targets past a row's end) and the document mask. Its memory holds one chunk's logits at a time.

Tolerance: fp32 on CPU, the chunked loss sums each token's loss and each chunk's weight-gradient share in another
order than one matmul and one reduction do, and takes the softmax's gradient as exp(logit - logsumexp): measured at
most 9.0e-8 relative on the loss and 6.5e-7 on any gradient (max |difference| over max |value|, per tensor; the
largest a DeepSeek-V3 query projection's, 4.6e-7 there with one chunk of all 48 tokens), for the cases below and
DeepSeek-V3 at 16, 48 and 100 tokens per chunk too; held to 1e-6.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchpre.evaluation.multiple_choice import _continuation_log_likelihoods
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.parallel.chunked_output import ChunkedOutput, ChunkedProjection, chunk_output_layer
from torchpre.parallel.forward_inputs import IGNORE_INDEX, future_tokens
from torchpre.parallel.linear_cross_entropy import linear_cross_entropy
from torchpre.planner.tensor_memory import TensorMemory
from torchpre.step_rules.batch import BatchSizes, CurrentBatch
from torchpre.training.loss import GlobalMeanLoss

RELATIVE = 1e-6
BATCH, SEQ = 2, 24
STEP = CurrentBatch(BatchSizes(BATCH, 1, BATCH, SEQ))  # one step of this batch: the loss divides by its tokens
LLAMA = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=300, max_seq_len=SEQ)
DSV3 = dataclasses.replace(
    DEEPSEEK_V3_FLAVORS["debugmodel"], vocab_size=300, max_seq_len=SEQ, mtp_depth=2, mtp_loss_weight=0.3
)
DOCUMENTS = torch.tensor([0] * 7 + [1] * 10 + [2] * 7).expand(BATCH, SEQ)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def twins(model_cls: type[nn.Module], args, chunk_size: int) -> tuple[nn.Module, nn.Module]:
    """The model and its copy with a chunked output layer, the same weights (drawn from the seed and each name)."""
    models = []
    for chunked in (False, True):
        model = model_cls(args)
        if chunked:
            chunk_output_layer(model, "output", chunk_size)
        model.init_weights(seed=0)
        if isinstance(model, DeepSeekV3Transformer):
            model.set_aux_loss_scale(1 / BATCH)
            model.set_token_loss_scale(1 / (BATCH * SEQ))
        models.append(model)
    return models[0], models[1]


def batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels, some labels ignored: a document's last position and a row's last three."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
    labels[:, 6] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return tokens, labels


@pytest.mark.parametrize(
    "family, chunk_size",
    [("llama3", 7), ("llama3", 16), ("llama3", 100), ("deepseek_v3_mtp", 7)],
    ids=["llama3-7-short-last", "llama3-16-divides", "llama3-100-more", "deepseek_v3_mtp-7-short-last"],
)
def test_chunked_loss_and_every_gradient_equal_the_full_logits(world, family, chunk_size):
    model_cls, args = (Transformer, LLAMA) if family == "llama3" else (DeepSeekV3Transformer, DSV3)
    full, chunked = twins(model_cls, args, chunk_size)
    assert isinstance(chunked.output, ChunkedOutput)
    tokens, labels = batch(args.vocab_size)
    kwargs = {"document_ids": DOCUMENTS}
    if family != "llama3":  # two depths: the targets past each row's end are IGNORE_INDEX
        kwargs["future_tokens"] = future_tokens(tokens, args.mtp_depth + 1)
    full_loss, chunked_loss = GlobalMeanLoss(STEP), GlobalMeanLoss(STEP)
    chunked_loss.project_with(ChunkedProjection(chunked))
    losses = []
    for model, loss_fn in ((full, full_loss), (chunked, chunked_loss)):
        hidden_or_logits = model(tokens, **kwargs)
        loss = loss_fn(hidden_or_logits, labels)
        loss.backward()
        losses.append(loss.detach())
    assert hidden_or_logits.shape == (BATCH, SEQ, args.dim)  # the chunked model returns its hidden states
    assert losses[1].dtype == torch.float32
    assert relative_error(losses[1], losses[0]) <= RELATIVE
    expected = dict(full.named_parameters())
    for name, param in chunked.named_parameters():
        assert relative_error(param.grad, expected[name].grad) <= RELATIVE, name
    if family != "llama3":  # the depths' losses, chunked too, are in those gradients and in their statistics
        assert torch.allclose(chunked.mtp.loss_sums, full.mtp.loss_sums, rtol=RELATIVE, atol=0)
        assert chunked.mtp.target_counts.tolist() == full.mtp.target_counts.tolist()


def test_validation_loss_and_choice_log_likelihoods_equal_the_full_logits():
    """What evaluation reads without gradients: the loss (validation) and the log-probabilities of chosen positions
    (multiple-choice scoring)."""
    full, chunked = twins(Transformer, LLAMA, chunk_size=5)
    tokens, labels = batch(LLAMA.vocab_size)
    projection = ChunkedProjection(chunked)
    loss = GlobalMeanLoss(STEP)
    loss.project_with(projection)
    with torch.no_grad():
        logits, hidden = full(tokens), chunked(tokens)
        assert relative_error(loss(hidden, labels), GlobalMeanLoss(STEP)(logits, labels)) <= RELATIVE
        mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        mask[0, 3:9], mask[1, 10:22] = True, True
        targets = labels.clamp(min=0)
        chunked_scores = _continuation_log_likelihoods(hidden, targets, mask, projection)
        assert relative_error(chunked_scores, _continuation_log_likelihoods(logits, targets, mask)) <= RELATIVE


def test_bfloat16_weight_gradient_accumulates_in_float32():
    """256 one-token chunks add their shares of the weight's gradient in fp32: the result is one 256-token chunk's up
    to the final rounding to bf16 (measured 1.1e-7 relative to the largest entry; a bf16 running sum of the 256
    shares is 3.5e-2 off the fp64 gradient, where fp32 accumulation is 3.0e-3 off it, the bf16 inputs' own rounding).
    Held to 2^-8. The loss is fp32."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 32, generator=generator).bfloat16()
    weight = (torch.randn(64, 32, generator=generator) / 6).bfloat16()
    labels = torch.randint(0, 64, (256,), generator=generator)
    grads, losses = [], []
    for chunk_size in (1, 256):
        w = weight.clone().requires_grad_()
        loss = linear_cross_entropy(hidden, w, labels, chunk_size)
        loss.backward()
        assert w.grad.dtype == torch.bfloat16
        grads.append(w.grad.float())
        losses.append(loss)
    assert losses[0].dtype == torch.float32
    assert relative_error(grads[0], grads[1]) <= 2**-8
    assert relative_error(losses[0], losses[1]) <= RELATIVE


def test_the_loss_holds_one_chunks_logits_at_most():
    """The tensor counter's peak over the loss's forward and backward (`TensorMemory`, every storage the ops make):
    at most one chunk's fp32 logits, the gradients of the hidden states and of the weight (fp32) and per-token
    vectors, and at most 1/8 of the full logits' peak (the bound bench/loss_memory.py shows at a 128,256 vocabulary)."""
    tokens, dim, vocab, chunk = 2048, 64, 8192, 128
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator) / 8
    labels = torch.randint(0, vocab, (tokens,), generator=generator)

    def peak(loss_fn) -> int:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with TensorMemory(("cpu",)) as memory:
            memory.begin_step()
            loss_fn(h, w).backward()
        return memory.peak - memory.step_start

    chunked = peak(lambda h, w: linear_cross_entropy(h, w, labels, chunk))
    full = peak(lambda h, w: F.cross_entropy((h @ w.T).float(), labels, reduction="sum"))
    bound = 4 * (chunk * vocab + tokens * dim + vocab * dim) + 64 * tokens
    assert chunked <= bound, (chunked, bound)
    assert chunked <= full / 8, (chunked, full)


def test_the_compiled_chunked_loss_equals_eager():
    """compile.enable compiles the chunked loss as one graph (`ChunkedProjection`, fullgraph); its loss and gradients
    equal eager's (measured: within 6.1e-8 relative on the loss, 9.9e-8 on the gradients)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 32, generator=generator)  # 24 tokens: a chunk of 16 and a short one
    labels = torch.randint(0, 300, (2, 12), generator=generator)
    labels[0, 5] = IGNORE_INDEX
    weight = torch.randn(300, 32, generator=generator) / 5
    results = []
    for compile in (False, True):
        h = hidden.clone().requires_grad_()
        part = nn.Sequential(ChunkedOutput(nn.Parameter(weight.clone()), chunk_size=16))
        loss = ChunkedProjection(part, compile=compile).cross_entropy_sum(part(h), labels)
        loss.backward()
        results.append((loss.detach(), h.grad, part[0].weight.grad))
    for compiled, eager in zip(results[1], results[0]):
        assert relative_error(compiled, eager) <= RELATIVE
