"""A parameter-server job for the split-layout launch test: ``split_ps_train.py OUT_DIR OPTIMIZER STEPS``.

The same file on servers and workers (``tests/ps_jobs.py``'s model and batches); each worker saves its
final parameters to ``OUT_DIR/worker<i>.pt`` and prints ``worker <i> of <n> servers <s> endpoints <e>``.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: ps_jobs

import fleet  # noqa: E402
from ps_jobs import train  # noqa: E402

out_dir, optimizer, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
result = train(0, optimizer, steps)
if "served" in result:  # a server: fleet.init() served until the workers stopped
    sys.exit(result["served"])
index, endpoints = fleet.worker_index(), ",".join(fleet.server_endpoints())
torch.save(result, os.path.join(out_dir, f"worker{index}.pt"))
print(f"worker {index} of {fleet.worker_num()} servers {fleet.server_num()} endpoints {endpoints}", flush=True)
