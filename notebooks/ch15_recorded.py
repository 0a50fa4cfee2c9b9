"""Chapter 15: the runs too heavy for the lesson, as the tests recorded them.

``tests/lessons/test_ch15_mesh.py`` (dp x ep x tp on 8 ranks) and ``tests/lessons/test_ch15_pp_cp.py``
(context parallelism with an MoE block on 4 ranks) write what they measured here when they pass with
``CH15_RECORD=1`` set; the lesson prints it.  ``RECORDED`` is written by ``update``, not by hand.
"""

import json
import os
import time
from pathlib import Path

import torch

RECORDED = {
    "CP with an MoE block, 4 ranks": {
        "test": "tests/lessons/test_ch15_pp_cp.py",
        "curves": {
            "one process": [
                0.8823264837265015,
                0.9102569818496704,
                0.8653500080108643,
                0.8302862644195557
            ],
            "CP (4), experts replicated": [
                0.8823264837265015,
                0.9102569818496704,
                0.865350067615509,
                0.8302862644195557
            ],
            "CP (4) + EP on the same ranks": [
                0.8823264837265015,
                0.9102569818496704,
                0.865350067615509,
                0.8302862644195557
            ]
        },
        "max_parameter_difference": {
            "CP (4), experts replicated": 2.9802322387695312e-08,
            "CP (4) + EP on the same ranks": 2.9802322387695312e-08
        },
        "seconds": 11.0,
        "date": "2026-12-05",
        "torch": "2.13.0+cpu",
        "cores": 2
    },
    "dp x ep x tp (2 x 2 x 2), 8 ranks": {
        "test": "tests/lessons/test_ch15_mesh.py",
        "curves": {
            "one process": [
                2.3131397366523743,
                2.2237643003463745,
                2.115821659564972,
                2.144441545009613
            ],
            "dp x ep x tp (2 x 2 x 2)": [
                2.3131396770477295,
                2.223764181137085,
                2.115821599960327,
                2.144441604614258
            ]
        },
        "seconds": 5.4,
        "date": "2026-12-05",
        "torch": "2.13.0+cpu",
        "cores": 2
    }
}


def update(key, test, curves, seconds, **extra):
    """Store one passing run's loss curves under ``key``, with its test, date, torch, cores and time.

    Does nothing unless the environment has ``CH15_RECORD=1`` (a plain test run leaves the file alone).
    """
    if os.environ.get("CH15_RECORD") != "1":
        return
    RECORDED[key] = {"test": test, "curves": curves, **extra, "seconds": round(seconds, 1),
                     "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cores": os.cpu_count()}
    path = Path(__file__)
    text = path.read_text()
    start, end = text.index("RECORDED = "), text.index("\n\n\ndef update")
    path.write_text(text[:start] + "RECORDED = " + json.dumps(RECORDED, indent=4) + text[end:])
