"""Launched by the tests under torchrun, mpirun and `nanocolossal run`: report who I am.

Prints one line `PROBE {json}` per rank with what gpc says and the sum of (rank + 1) over
all ranks, which proves the process group really connects every process.
"""
import gc
import json
import os

import torch
import torch.distributed as dist

import nanocolossal as nc

gc.freeze()  # exit skips a final sweep over torch's objects (over a second per process)

torch.set_num_threads(1)
parser = nc.get_default_parser()
parser.add_argument("--mode", choices=["torch", "openmpi", "slurm"], default="torch")
args = parser.parse_args()
config = args.config or {}
if args.mode == "torch":
    nc.launch_from_torch(config, backend=args.backend, timeout=60)
elif args.mode == "openmpi":
    nc.launch_from_openmpi(config, host=args.host, port=args.port, backend=args.backend, timeout=60)
else:
    nc.launch_from_slurm(config, host=args.host, port=args.port, backend=args.backend, timeout=60)

total = torch.tensor([nc.gpc.rank + 1.0])
dist.all_reduce(total)
report = dict(rank=nc.gpc.rank, world_size=nc.gpc.world_size, local_rank=nc.gpc.local_rank,
              backend=nc.gpc.backend, device=str(nc.gpc.device), sum=total.item(),
              batch_size=nc.gpc.config.get("BATCH_SIZE"), pid=os.getpid(),
              parent=os.getppid())
# One write per line: ranks share the pipe, and print() writes text and newline separately.
os.write(1, ("PROBE " + json.dumps(report) + "\n").encode())
nc.gpc.destroy()
