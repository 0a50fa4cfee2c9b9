"""Chapter 01 checkers accept the right answers and reject the usual mistakes by name."""

from __future__ import annotations

import pytest
import torch
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file
from torch import nn

from course_utils import CheckFailed
from course_utils.checks import check_evaluate, check_shard_gradients, check_train_step
from course_utils.checks.ch01 import a_train_step, b_evaluate, c_shard_gradients

# --------------------------------------------------------------------------------------------
# 01.a training step with gradient clipping
# --------------------------------------------------------------------------------------------


def good_step(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss.item(), norm.item()


def step_detached_zero_after(model, opt, x, y, max_norm):
    """Returns detached tensors (no device sync per step); clears the gradients after the step."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), norm


def step_total_norm_then_scale(model, opt, x, y, max_norm):
    """The two halves of clip_grad_norm_: measure the global norm, then scale by it."""
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.nll_loss(model(x).log_softmax(dim=1), y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    opt.step()
    return loss.item(), norm.item()


def step_by_hand(model, opt, x, y, max_norm):
    """Clipping written out: the norm of all gradients as one vector, one factor for all."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    if total > max_norm:
        for p in model.parameters():
            p.grad *= max_norm / total
    opt.step()
    return loss.item(), float(total)


def clip_before_backward(model, opt, x, y, max_norm):
    opt.zero_grad()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item(), norm.item()


def clip_after_step(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return loss.item(), norm.item()


def never_clips(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    return loss.item(), norm.item()


def clip_each_parameter(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norms = [nn.utils.clip_grad_norm_(p, max_norm) for p in model.parameters()]
    opt.step()
    return loss.item(), torch.stack(norms).norm().item()


def clip_values(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    nn.utils.clip_grad_value_(model.parameters(), max_norm)
    opt.step()
    return loss.item(), norm.item()


def norm_as_sum(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    total = sum(p.grad.norm() for p in model.parameters())
    if total > max_norm:
        for p in model.parameters():
            p.grad.mul_(max_norm / total)
    opt.step()
    return loss.item(), total.item()


def rescale_always(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    for p in model.parameters():
        p.grad.mul_(max_norm / total)
    opt.step()
    return loss.item(), total.item()


def zero_grad_before_step(model, opt, x, y, max_norm):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.zero_grad()
    opt.step()
    return loss.item(), norm.item()


def no_zero_grad(model, opt, x, y, max_norm):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss.item(), norm.item()


def no_step(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return loss.item(), norm.item()


def norm_after_clipping(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    return loss.item(), norm.item()


def returns_graph(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss, norm


def summed_loss(model, opt, x, y, max_norm):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss.item(), norm.item()


def returns_loss_only(model, opt, x, y, max_norm):
    return good_step(model, opt, x, y, max_norm)[0]


@pytest.mark.parametrize("right", [good_step, step_detached_zero_after, step_total_norm_then_scale,
                                   step_by_hand], ids=lambda f: f.__name__)
def test_train_step_accepts_several_right_answers(right, capsys):
    check_train_step(right)
    out = capsys.readouterr().out
    assert "max_norm below and above" in out and "[PASS] 01.a training step" in out


# Each misconception of 01.a (a_train_step.CATALOGUE): the wrong step of that name
# and what the failure says.
WRONG_A = {f.__name__: (f, message) for f, message in [
    (clip_before_backward, r"step 0 .*stepped with the unclipped gradients.*after loss.backward\(\).*before "
                           r"optimizer.step\(\)"),
    (never_clips, r"stepped with the unclipped gradients"),
    (clip_after_step, r"clipped after optimizer.step\(\).*between loss.backward\(\) and optimizer.step"),
    (clip_each_parameter, r"clipped by its own norm.*all the gradients together"),
    (clip_values, r"element by element.*direction"),
    (norm_as_sum, r"step 0 .*sum of the parameters' norms.*square root of the sum of the squared"),
    (rescale_always, r"step 1 .*scaled up to max_norm.*only shrinks"),
    (zero_grad_before_step, r"zero_grad\(\) between loss.backward\(\) and optimizer.step\(\) erased"),
    (no_zero_grad, r"step 1 .*left from the previous step.*Call `optimizer.zero_grad\(\)`"),
    (no_step, r"call `optimizer.step\(\)`"),
    (norm_after_clipping, r"step 0: returned norm .*after clipping.*before clipping"),
    (returns_graph, r"still holds the autograd graph.*`loss.item\(\)` or `loss.detach\(\)`"),
    (summed_loss, r"summed over the batch.*mean over the batch"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(a_train_step.CATALOGUE, WRONG_A))
def test_train_step_rejects_usual_mistakes(mistake, wrong):
    step, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_train_step(step)
    assert mistake.message in info.value.args[0]


@pytest.mark.parametrize("wrong, message", [
    (returns_loss_only, r"should return two numbers"),
    (None, "got None"),
    (42, "expected train_step.*got a int"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_train_step_rejects_answers_of_the_wrong_shape(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_train_step(wrong)


def test_crash_inside_learner_code_is_reported():
    def crashes(model, opt, x, y, max_norm):
        return model(x[:, :5]).sum().item()  # wrong input width

    with pytest.raises(CheckFailed, match=r"01.a training step\] your code raised RuntimeError"):
        check_train_step(crashes)


def test_stub_says_not_done():
    def stub(model, opt, x, y, max_norm):
        raise NotImplementedError("Exercise 01.a training step: replace this line with your code")

    with pytest.raises(CheckFailed, match="not done yet.*Exercise 01.a training step"):
        check_train_step(stub)


# --------------------------------------------------------------------------------------------
# 01.b evaluation
# --------------------------------------------------------------------------------------------


def good_eval(model, loader):
    was_training = model.training
    model.eval()
    correct = loss_sum = total = 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            total += len(y)
    model.train(was_training)
    return correct / total, loss_sum / total


def eval_inference_mode_cat(model, loader):
    """All outputs first, one loss and one comparison at the end; inference_mode, tensors returned."""
    mode = model.training
    model.eval()
    with torch.inference_mode():
        logits = torch.cat([model(x) for x, _ in loader])
        labels = torch.cat([y for _, y in loader])
    model.train(mode)
    return (logits.argmax(1) == labels).float().mean(), nn.functional.cross_entropy(logits, labels)


def eval_weighted_batches(model, loader):
    """Per-batch means weighted by batch size, divided by the size of the data set."""
    training = model.training
    model.eval()
    acc = loss = 0.0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            acc += (out.argmax(1) == y).float().mean().item() * len(y)
            loss += nn.functional.cross_entropy(out, y).item() * len(y)
    if training:
        model.train()
    return acc / len(loader.dataset), loss / len(loader.dataset)


def eval_no_restore(model, loader):
    model.eval()
    correct = loss_sum = total = 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            total += len(y)
    return correct / total, loss_sum / total


def eval_back_to_train(model, loader):
    """The lesson's pattern, model.train() at the end: right for a model that was training."""
    model.eval()
    correct = loss_sum = total = 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            total += len(y)
    model.train()
    return correct / total, loss_sum / total


def eval_with_grad(model, loader):
    was_training = model.training
    model.eval()
    correct = loss_sum = total = 0
    for x, y in loader:
        out = model(x)
        correct += (out.argmax(1) == y).sum().item()
        loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
        total += len(y)
    model.train(was_training)
    return correct / total, loss_sum / total


def eval_train_mode(model, loader):
    correct = loss_sum = total = 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            total += len(y)
    return correct / total, loss_sum / total


def eval_mean_of_batch_losses(model, loader):
    was_training = model.training
    model.eval()
    correct = total = 0
    losses = []
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            losses.append(nn.functional.cross_entropy(out, y).item())
            total += len(y)
    model.train(was_training)
    return correct / total, sum(losses) / len(losses)


def eval_mean_of_batch_accuracies(model, loader):
    was_training = model.training
    model.eval()
    accs, loss_sum, total = [], 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            accs.append((out.argmax(1) == y).float().mean().item())
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            total += len(y)
    model.train(was_training)
    return sum(accs) / len(accs), loss_sum / total


def eval_full_batches(model, loader):
    was_training = model.training
    model.eval()
    correct = loss_sum = 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
    model.train(was_training)
    n = len(loader) * loader.batch_size
    return correct / n, loss_sum / n


def eval_percent(model, loader):
    acc, loss = good_eval(model, loader)
    return 100 * acc, loss


def eval_swapped(model, loader):
    acc, loss = good_eval(model, loader)
    return loss, acc


def eval_accuracy_only(model, loader):
    return good_eval(model, loader)[0]


@pytest.mark.parametrize("right", [good_eval, eval_inference_mode_cat, eval_weighted_batches],
                         ids=lambda f: f.__name__)
def test_evaluate_accepts_several_right_answers(right, capsys):
    check_evaluate(right)
    out = capsys.readouterr().out
    assert "each left as it was" in out and "[PASS] 01.b evaluation" in out


# Each misconception of 01.b (b_evaluate.CATALOGUE): the wrong evaluation of that name
# and what the failure says.
WRONG_B = {f.__name__: (f, message) for f, message in [
    (eval_no_restore, r"model in training mode.*after evaluate\(\) the model was in eval mode.*"
                      r"model.train\(was_training\)"),
    (eval_back_to_train, r"model in eval mode.*after evaluate\(\) the model was in training mode.*"
                         r"already in eval mode must stay there"),
    (eval_with_grad, r"autograd on.*torch.no_grad"),
    (eval_train_mode, r"training mode: call `model.eval\(\)`"),
    (eval_mean_of_batch_losses, r"\(the last one 40\): mean loss .*mean of per-batch mean loss values.*"
                                r"Weigh each batch by its size"),
    (eval_mean_of_batch_accuracies, r"accuracy .*mean of per-batch accuracy values"),
    (eval_full_batches, r"len\(loader\) \* batch_size = 1024 samples.*the loader holds 1000"),
    (eval_percent, "not a percentage"),
    (eval_swapped, "swapped"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(b_evaluate.CATALOGUE, WRONG_B))
def test_evaluate_rejects_usual_mistakes(mistake, wrong):
    evaluate, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_evaluate(evaluate)
    assert mistake.message in info.value.args[0]


def test_evaluate_rejects_a_single_number():
    with pytest.raises(CheckFailed, match=r"two numbers, \(accuracy, mean loss\)"):
        check_evaluate(eval_accuracy_only)


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


# Each misconception of 01.c (c_shard_gradients.CATALOGUE): the wrong answer of that name
# and what the failure says.
WRONG_C = {f.__name__: (f, message) for f, message in [
    (shards_mean_of_means, r"batch of 10 on 4 shard\(s\) \(shards of \[3, 3, 2, 2\] rows\) you averaged.*"
                           r"weighs every shard equally.*rows_k / batch"),
    (shards_summed, r"batch of 12 on 3 shard\(s\).*SUM of the shards' gradients, 3x too large"),
    (shards_no_zero, r"added to the gradients already in \.grad"),
    (shards_chunk, r"batch of 5 on 4 shard\(s\) the model ran on 3 shard\(s\) of sizes \[2, 2, 1\].*"
                   r"torch\.tensor_split gives exactly n"),
    (shards_whole_batch, r"ran once, on the whole batch.*each shard separately"),
    (shards_with_step, r"the parameters changed"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(c_shard_gradients.CATALOGUE, WRONG_C))
def test_shards_reject_usual_mistakes(mistake, wrong):
    shard_gradients, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_shard_gradients(shard_gradients)
    assert mistake.message in info.value.args[0]


def test_shards_reject_none():
    with pytest.raises(CheckFailed, match="got None"):
        check_shard_gradients(None)
