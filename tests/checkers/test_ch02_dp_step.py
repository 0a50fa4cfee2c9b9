"""Chapter 02 checker: one DataParallel step on CPU from scatter / replicate / apply / gather.

``check_dp_step`` must accept a correct step and reject the usual mistakes, each with a message
that names it.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from misconceptions import cases  # tests/checkers/misconceptions.py, beside this file

from course_utils.checking import CheckFailed
from course_utils.checks import check_dp_step
from course_utils.checks.ch02 import CATALOGUE


def _replicas(model, n):
    return [copy.deepcopy(model, memo={id(p): p.clone() for p in model.parameters()})
            for _ in range(n)]


def _in_threads(replicas, chunks):
    outputs = [None] * len(chunks)

    def run(i):
        outputs[i] = replicas[i](chunks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chunks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs


def dp_step_right(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    outputs = _in_threads(_replicas(model, len(chunks)), chunks)
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_sum_of_losses(model, x, y, n_devices):
    chunks, targets = x.chunk(n_devices), y.chunk(n_devices)
    outputs = _in_threads(_replicas(model, len(chunks)), chunks)
    loss = sum(F.cross_entropy(o, t) for o, t in zip(outputs, targets))
    loss.backward()
    return torch.cat(outputs), loss


def dp_step_mean_of_means(model, x, y, n_devices):
    chunks, targets = x.chunk(n_devices), y.chunk(n_devices)
    outputs = _in_threads(_replicas(model, len(chunks)), chunks)
    loss = sum(F.cross_entropy(o, t) for o, t in zip(outputs, targets)) / len(chunks)
    loss.backward()
    return torch.cat(outputs), loss


def dp_step_detached_replicas(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    outputs = _in_threads([copy.deepcopy(model) for _ in chunks], chunks)
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_sequential(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    replicas = _replicas(model, len(chunks))
    out = torch.cat([r(c) for r, c in zip(replicas, chunks)])
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_gather_as_finished(model, x, y, n_devices):
    """Appends outputs in completion order; made deterministic here: the last chunk finishes first."""
    chunks = x.chunk(n_devices)
    outputs = _in_threads(_replicas(model, len(chunks)), chunks)
    out = torch.cat(outputs[::-1])
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_tensor_split(model, x, y, n_devices):
    chunks = x.tensor_split(n_devices)
    outputs = _in_threads(_replicas(model, len(chunks)), chunks)
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_no_replicas(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    outputs = _in_threads([model] * len(chunks), chunks)
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_no_backward(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    out = torch.cat(_in_threads(_replicas(model, len(chunks)), chunks))
    return out, F.cross_entropy(out, y)


def dp_step_thread_pool(model, x, y, n_devices):
    """A pool with one worker per replica; map keeps the chunk order."""
    chunks = x.chunk(n_devices)
    replicas = _replicas(model, len(chunks))
    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        outputs = list(pool.map(lambda rc: rc[0](rc[1]), zip(replicas, chunks)))
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_reduce_add_by_hand(model, x, y, n_devices):
    """Plain deepcopy replicas, whose gradients are then summed into the model by hand."""
    chunks = x.chunk(n_devices)
    replicas = [copy.deepcopy(model) for _ in chunks]
    out = torch.cat(_in_threads(replicas, chunks))
    loss = F.cross_entropy(out, y)
    loss.backward()
    for name, p in model.named_parameters():
        p.grad = sum(dict(r.named_parameters())[name].grad for r in replicas)
    return out, loss


def dp_step_one_worker_thread(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    replicas = _replicas(model, len(chunks))
    outputs = []
    worker = threading.Thread(target=lambda: outputs.extend(r(c) for r, c in zip(replicas, chunks)))
    worker.start()
    worker.join()
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_small_pool(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    replicas = _replicas(model, len(chunks))
    with ThreadPoolExecutor(max_workers=2) as pool:
        outputs = list(pool.map(lambda rc: rc[0](rc[1]), zip(replicas, chunks)))
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_join_each(model, x, y, n_devices):
    chunks = x.chunk(n_devices)
    replicas = _replicas(model, len(chunks))
    outputs = [None] * len(chunks)

    def run(i):
        outputs[i] = replicas[i](chunks[i])

    for i in range(len(chunks)):
        t = threading.Thread(target=run, args=(i,))
        t.start()
        t.join()  # waits for this replica before the next one starts
    out = torch.cat(outputs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out, loss


def dp_step_with_optimizer_step(model, x, y, n_devices):
    out, loss = dp_step_right(model, x, y, n_devices)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return out, loss


@pytest.mark.parametrize("right", [dp_step_right, dp_step_thread_pool, dp_step_reduce_add_by_hand],
                         ids=lambda f: f.__name__)
def test_accepts_several_right_steps(right, capsys):
    check_dp_step(right)
    assert "[PASS] 02.a data parallel step" in capsys.readouterr().out


# Each misconception of the catalogue: the wrong step of the same name, and what the failure says.
WRONG = {f.__name__: (f, message) for f, message in [
    (dp_step_sum_of_losses, r"SUM of the \d+ replicas' mean losses"),
    (dp_step_mean_of_means, r"average of the per-replica mean losses"),
    (dp_step_detached_replicas, r"have no gradient.*detached copies"),
    (dp_step_no_backward, r"have no gradient.*backward\(\) was not called"),
    (dp_step_sequential, r"every replica ran in the calling thread"),
    (dp_step_gather_as_finished, r"right rows in the wrong order"),
    (dp_step_tensor_split, r"cuts the batch like torch\.chunk"),
    (dp_step_no_replicas, r"the original `model` ran on a chunk"),
    (dp_step_one_worker_thread, r"ran in 1 thread\(s\).*one thread per replica, not one thread running "
                                r"them all"),
    (dp_step_small_pool, r"ran in 2 thread\(s\).*one thread per replica"),
    (dp_step_join_each, r"did not run at the same time.*start, join, start, join"),
    (dp_step_with_optimizer_step, r"changed the parameters"),
]}


@pytest.mark.parametrize("mistake, wrong", cases(CATALOGUE, WRONG))
def test_rejects_typical_mistakes(mistake, wrong):
    step, message = wrong
    with pytest.raises(CheckFailed, match=message) as info:
        check_dp_step(step)
    assert mistake.message in info.value.args[0]


def test_rejects_stub_none_and_bad_return():
    def stub(model, x, y, n_devices):
        raise NotImplementedError("Exercise 02.a data parallel step: replace this line")

    with pytest.raises(CheckFailed, match="not done yet"):
        check_dp_step(stub)
    with pytest.raises(CheckFailed, match="got None"):
        check_dp_step(None)
    with pytest.raises(CheckFailed, match="returned None"):
        check_dp_step(lambda model, x, y, n: None)
    with pytest.raises(CheckFailed, match=r"expected shape \(8, 10\)"):
        check_dp_step(lambda model, x, y, n: (model(x[:4]), torch.tensor(0.0)))


def test_reports_exceptions_with_the_case():
    def crashes_on_uneven(model, x, y, n_devices):
        if x.shape[0] % n_devices:
            raise ValueError("batch does not split evenly")
        return dp_step_right(model, x, y, n_devices)

    with pytest.raises(CheckFailed, match=r"ValueError: batch does not split evenly \(for a batch "
                                          r"of 10 on 4 device\(s\); the chunks have sizes"):
        check_dp_step(crashes_on_uneven)
