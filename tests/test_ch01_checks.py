"""Chapter 01 checkers accept the right answers and reject the usual mistakes by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_utils import CheckFailed
from course_utils.checks import check_evaluate, check_train_step


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


def test_train_step_accepts_the_reference(capsys):
    check_train_step(good_step)
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


def test_evaluate_accepts_the_reference(capsys):
    check_evaluate(good_eval)
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
