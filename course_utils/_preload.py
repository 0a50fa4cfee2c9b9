"""Imported once by the launcher's fork server so that every worker starts with torch loaded."""

import cloudpickle  # noqa: F401
import torch  # noqa: F401

# DistributedDataParallel's constructor imports torch._dynamo (sympy and more): 1.5 s or more in
# every worker of every launch unless the fork server has imported it once, here.
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.nn  # noqa: F401
import torch.nn.parallel  # noqa: F401

import course_utils.workers.entry  # noqa: F401
