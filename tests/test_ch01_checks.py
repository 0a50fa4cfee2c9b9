"""Chapter 01 checkers accept the right answers and reject the usual mistakes by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_utils import CheckFailed
from course_utils.checks import check_evaluate, check_shard_gradients, check_train_step


def good_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def no_zero_grad(model, opt, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def no_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


def returns_graph(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def summed_loss(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    opt.step()
    return loss.item()


def step_zeroes_after(model, opt, x, y):
    """Clears the gradients at the end of the step instead of the start: the same updates."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    for p in model.parameters():
        p.grad = None
    return loss.item()


def step_log_softmax(model, opt, x, y):
    """The same loss spelled as log_softmax + nll_loss, gradients zeroed in place."""
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.nll_loss(model(x).log_softmax(dim=1), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("right", [good_step, step_zeroes_after, step_log_softmax],
                         ids=lambda f: f.__name__)
def test_train_step_accepts_several_right_answers(right, capsys):
    check_train_step(right)
    assert "[PASS] 01.a training step" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (no_zero_grad, "call `optimizer.zero_grad\\(\\)`"),
    (no_step, "call `optimizer.step\\(\\)`"),
    (returns_graph, "Return `loss.item\\(\\)`"),
    (summed_loss, "the mean over the batch"),
    (None, "got None"),
    (42, "expected train_step.*got a int"),
])
def test_train_step_rejects_usual_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_train_step(wrong)


def test_crash_inside_learner_code_is_reported():
    def crashes(model, opt, x, y):
        return model(x[:, :5]).sum().item()  # wrong input width

    with pytest.raises(CheckFailed, match=r"01.a training step\] your code raised RuntimeError"):
        check_train_step(crashes)


def test_stub_says_not_done():
    def stub(model, opt, x, y):
        raise NotImplementedError("Exercise 01.a training step: replace this line with your code")

    with pytest.raises(CheckFailed, match="not done yet.*Exercise 01.a training step"):
        check_train_step(stub)


def good_eval(model, loader):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return correct / total


def eval_with_grad(model, loader):
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    return correct / total


def eval_train_mode(model, loader):
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return correct / total


def eval_mean_of_batches(model, loader):
    model.eval()
    accs = []
    with torch.no_grad():
        for x, y in loader:
            accs.append((model(x).argmax(1) == y).float().mean().item())
    return sum(accs) / len(accs)


def eval_percent(model, loader):
    return 100 * good_eval(model, loader)


def eval_inference_mode_cat(model, loader):
    """All predictions first, one comparison at the end; inference_mode instead of no_grad."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        preds = torch.cat([model(x).argmax(1) for x, _ in loader])
        labels = torch.cat([y for _, y in loader])
    model.train(was_training)
    return (preds == labels).float().mean()


def eval_weighted_batches(model, loader):
    """Per-batch accuracies weighted by batch size: the same fraction."""
    model.eval()
    acc = n = 0.0
    with torch.no_grad():
        for x, y in loader:
            acc += (model(x).argmax(1) == y).float().mean().item() * len(y)
            n += len(y)
    return acc / n


@pytest.mark.parametrize("right", [good_eval, eval_inference_mode_cat, eval_weighted_batches],
                         ids=lambda f: f.__name__)
def test_evaluate_accepts_several_right_answers(right, capsys):
    check_evaluate(right)
    assert "[PASS] 01.b evaluation" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (eval_with_grad, "torch.no_grad"),
    (eval_train_mode, "model.eval"),
    (eval_mean_of_batches, "averaging per-batch accuracies"),
    (eval_percent, "not a percentage"),
])
def test_evaluate_rejects_usual_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_evaluate(wrong)


# --------------------------------------------------------------------------------------------
# 01.c gradient from shards
# --------------------------------------------------------------------------------------------


def shards_weighted_backward(model, x, y, n_shards):
    """Each shard's backward adds rows_k / batch x its gradient into .grad, zeroed first."""
    model.zero_grad()
    for xs, ys in zip(x.tensor_split(n_shards), y.tensor_split(n_shards)):
        (nn.functional.cross_entropy(model(xs), ys) * len(xs) / len(x)).backward()


def shards_autograd_grad(model, x, y, n_shards):
    """One gradient per shard (as each rank would hold), then their weighted sum into .grad."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for xs, ys in zip(x.tensor_split(n_shards), y.tensor_split(n_shards)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xs), ys), params)
        for t, g in zip(total, grads):
            t += g * len(xs) / len(x)
    for p, t in zip(params, total):
        p.grad = t


def shards_summed_losses_one_backward(model, x, y, n_shards):
    """Per-shard forwards, per-sample sums, one backward: the same gradient."""
    model.zero_grad()
    loss = sum(nn.functional.cross_entropy(model(xs), ys, reduction="sum")
               for xs, ys in zip(x.tensor_split(n_shards), y.tensor_split(n_shards)))
    (loss / len(x)).backward()


def shards_mean_of_means(model, x, y, n_shards):
    model.zero_grad()
    for xs, ys in zip(x.tensor_split(n_shards), y.tensor_split(n_shards)):
        (nn.functional.cross_entropy(model(xs), ys) / n_shards).backward()


def shards_summed(model, x, y, n_shards):
    model.zero_grad()
    for xs, ys in zip(x.tensor_split(n_shards), y.tensor_split(n_shards)):
        nn.functional.cross_entropy(model(xs), ys).backward()


def shards_no_zero(model, x, y, n_shards):
    for xs, ys in zip(x.tensor_split(n_shards), y.tensor_split(n_shards)):
        (nn.functional.cross_entropy(model(xs), ys) * len(xs) / len(x)).backward()


def shards_chunk(model, x, y, n_shards):
    model.zero_grad()
    for xs, ys in zip(x.chunk(n_shards), y.chunk(n_shards)):
        (nn.functional.cross_entropy(model(xs), ys) * len(xs) / len(x)).backward()


def shards_whole_batch(model, x, y, n_shards):
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def shards_with_step(model, x, y, n_shards):
    shards_weighted_backward(model, x, y, n_shards)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


@pytest.mark.parametrize("right", [shards_weighted_backward, shards_autograd_grad,
                                   shards_summed_losses_one_backward], ids=lambda f: f.__name__)
def test_shards_accept_several_right_answers(right, capsys):
    check_shard_gradients(right)
    assert "[PASS] 01.c gradient from shards" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (shards_mean_of_means, r"batch of 10 on 4 shard\(s\) \(shards of \[3, 3, 2, 2\] rows\) you averaged.*"
                           r"weighs every shard equally.*rows_k / batch"),
    (shards_summed, r"batch of 12 on 3 shard\(s\).*SUM of the shards' gradients, 3x too large"),
    (shards_no_zero, r"added to the gradients already in \.grad"),
    (shards_chunk, r"batch of 5 on 4 shard\(s\) the model ran on 3 shard\(s\) of sizes \[2, 2, 1\].*"
                   r"torch\.tensor_split gives exactly n"),
    (shards_whole_batch, r"ran once, on the whole batch.*each shard separately"),
    (shards_with_step, r"the parameters changed"),
    (None, "got None"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_shards_reject_usual_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_shard_gradients(wrong)
