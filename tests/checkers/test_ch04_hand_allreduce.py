"""Chapter 04.a: data-parallel training with a hand-written gradient all-reduce.

The checker runs the function in real gloo workers on 2 and 3 ranks, next to torch DDP; it must
accept a right answer and name each usual mistake.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_hand_allreduce
from course_utils.checks.ch04.a_hand_allreduce import CATALOGUE

# Ship this module's functions to the workers by value: no import path needed there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _broadcast(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)


def right(model, batches, lr):
    world = dist.get_world_size()
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    return model


def right_with_a_flat_buffer(model, batches, lr):
    # One all-reduce per step over all gradients, as DDP's buckets do.
    world = dist.get_world_size()
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
        opt.step()
    return model


def right_dividing_first(model, batches, lr):
    world = dist.get_world_size()
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        (F.cross_entropy(model(x), y) / world).backward()  # then the sum is the mean
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    return model


def sums_instead_of_averaging(model, batches, lr):
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    return model


def no_initial_broadcast(model, batches, lr):
    world = dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    return model


def _average_the_weights(model):
    world = dist.get_world_size()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)
            p /= world


def averages_initial_weights(model, batches, lr):
    # "averaging the initial weights makes the ranks agree, like the broadcast": they agree on the mean
    _average_the_weights(model)
    return no_initial_broadcast(model, batches, lr)  # then the gradients averaged as they should be


def broadcasts_then_averages_the_same_weights(model, batches, lr):
    # Right: after the broadcast every rank holds rank 0's weights, so averaging them changes nothing.
    _broadcast(model)
    _average_the_weights(model)
    return right(model, batches, lr)


def all_reduce_before_backward(model, batches, lr):
    world = dist.get_world_size()
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        for p in model.parameters():
            if p.grad is not None:  # zero_grad() set them to None: nothing is ever sent
                dist.all_reduce(p.grad)
                p.grad /= world
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def averages_the_loss(model, batches, lr):
    # "averaging the loss over the ranks averages the gradients"
    world = dist.get_world_size()
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        dist.all_reduce(loss)
        (loss / world).backward()
        opt.step()
    return model


def _step_then_average(model, batches, lr, average):
    # "averaging the weights after each step is the same": with SGD it reaches DDP's numbers
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            average(list(model.parameters()), dist.get_world_size())
    return model


def _each_in_place(params, world):
    for p in params:
        dist.all_reduce(p.data)
        p.data /= world


def _each_as_a_copy(params, world):
    for p in params:
        mean = p.detach().clone()
        dist.all_reduce(mean)
        p.copy_(mean / world)


def _all_in_one_buffer(params, world):
    flat = torch.cat([p.reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p, part in zip(params, (flat / world).split([p.numel() for p in params])):
        p.copy_(part.view_as(p))


def averages_parameters(model, batches, lr):
    return _step_then_average(model, batches, lr, _each_in_place)


def averages_copies_of_the_parameters(model, batches, lr):
    return _step_then_average(model, batches, lr, _each_as_a_copy)


def averages_the_parameters_in_one_buffer(model, batches, lr):
    return _step_then_average(model, batches, lr, _all_in_one_buffer)


@pytest.mark.parametrize("answer", [averages_copies_of_the_parameters,
                                    averages_the_parameters_in_one_buffer], ids=lambda f: f.__name__)
def test_averaging_copies_of_the_parameters_is_named_too(answer, no_leftover_processes):
    with pytest.raises(CheckFailed, match=r"all-reduced the parameters, not their gradients"):
        check_hand_allreduce(answer, world_sizes=(2,))


def weights_only(model, batches, lr):
    world = dist.get_world_size()
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    return model


def forgets_return(model, batches, lr):
    right(model, batches, lr)


def rank0_only(model, batches, lr):
    world = dist.get_world_size()
    _broadcast(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if dist.get_rank() == 0:  # the other ranks never join: rank 0 waits forever
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    return model


@pytest.mark.parametrize("answer", [right, right_with_a_flat_buffer, right_dividing_first,
                                    broadcasts_then_averages_the_same_weights],
                         ids=lambda f: f.__name__)
def test_accepts_right_answers(answer, capsys, no_leftover_processes):
    check_hand_allreduce(answer)
    assert "[PASS] 04.a hand-written all-reduce" in capsys.readouterr().out


# Each misconception of the catalogue: the wrong answer of the same name, what the failure says,
# and the checker's arguments where they differ from its defaults.
WRONG = {
    "sums_instead_of_averaging": (sums_instead_of_averaging,
                                  r"SUM of the gradients .* did not divide by the world size \(2\)", {}),
    "no_initial_broadcast": (no_initial_broadcast,
                             r"Usual mistake: not broadcasting the initial weights", {}),
    "averages_initial_weights": (averages_initial_weights,
                                 r"(?s)all-reduced the parameters before the first backward \(\d+ call\(s\)\)"
                                 r".*on the mean of their starts.*dist\.broadcast", {}),
    "all_reduce_before_backward": (all_reduce_before_backward, r"its gradients were never all-reduced", {}),
    "averages_the_loss": (averages_the_loss,
                          r"(?s)all-reduced a tensor of the autograd graph \(the loss\).*does not "
                          r"average the gradients.*all-reduce every p\.grad", {}),
    "averages_parameters": (averages_parameters,
                            r"(?s)all-reduced the parameters, not their gradients \(\d+ call\(s\) "
                            r"given a parameter.*only because SGD's update is linear.*with Adam", {}),
    "weights_only": (weights_only, r"(?s)net\.0\.bias .*DIFFERENT.*all-reducing only some parameters", {}),
    "forgets_return": (forgets_return, r"returned None on rank 0; expected the trained model", {}),
    # Rank 1 finishes and leaves while rank 0 waits in all_reduce; if rank 1 could not leave, the
    # launch timeout would end it with the same advice: the check fails instead of hanging.
    "rank0_only": (rank0_only, r"did not call the same collectives.*inside `if rank == 0:`",
                   {"world_sizes": (2,), "timeout": 20}),
}


@pytest.mark.parametrize("mistake, wrong", cases(CATALOGUE, WRONG))
def test_rejects_usual_mistakes(mistake, wrong, no_leftover_processes):
    answer, message, kwargs = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_hand_allreduce(answer, **kwargs)
    assert info.value.args[0].startswith("[04.a hand-written all-reduce]")
    assert mistake.message in info.value.args[0]


def test_stub_and_non_callable():
    def stub(model, batches, lr):
        raise NotImplementedError("Exercise 04.a hand-written all-reduce: replace this line")

    with pytest.raises(CheckFailed, match=r"not done yet"):
        check_hand_allreduce(stub)
    with pytest.raises(CheckFailed, match=r"got None"):
        check_hand_allreduce(None)
