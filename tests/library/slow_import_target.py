"""A worker function in a module that takes a while to import, only inside a worker.

Workers import the module of a function pickled by reference (as cloudpickle ships functions
defined in an importable module) before they can run it: that is start-up, not the function's time.
"""

import os
import time

time.sleep(float(os.environ.get("COURSE_TEST_IMPORT_DELAY", "0")))  # set only in the workers' env


def quick() -> int:
    return int(os.environ["RANK"])
