"""Imported once by the launcher's fork server so that every worker starts with torch loaded."""

import cloudpickle  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.nn  # noqa: F401

import course_utils.launcher  # noqa: F401
