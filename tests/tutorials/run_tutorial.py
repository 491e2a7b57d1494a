"""Run a tutorial file as its reader would, on tiny CIFAR-10 files.

    torchrun --nproc_per_node 2 run_tutorial.py [NAME=VALUE ...] TUTORIAL.py [tutorial args]

(test_tutorials.py runs it on pooled ranks with torchrun's environment, dist_helpers.run_script;
under torchrun itself it runs the same.) Three things differ from a real machine, all here and
not in the tutorial files: the tiny CIFAR files cannot match the real archive's MD5
(torchvision's check is relaxed), with TUTORIAL_EPOCHS=N the Trainer runs at most N epochs (the
pipeline tutorial hard-codes 60), and a pooled rank, a daemonic process forked from a server,
may fork the tutorials' DataLoader workers (num_workers=1) as a fresh interpreter would.
NAME=VALUE arguments set environment variables first. Whatever it patches is put back
afterwards: a pooled rank runs other jobs next.
"""
import multiprocessing
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torchvision.datasets.cifar as tv_cifar  # noqa: E402
from cifar_files import skip_cifar_md5  # noqa: E402

from nanocolossal.trainer import Trainer  # noqa: E402

args = sys.argv[1:]
while args and "=" in args[0] and not args[0].endswith(".py"):
    name, value = args.pop(0).split("=", 1)
    os.environ[name] = value
check, fit = tv_cifar.check_integrity, Trainer.fit
mp_config = multiprocessing.current_process()._config
daemon, method = mp_config.get("daemon"), multiprocessing.get_start_method()
try:
    skip_cifar_md5()
    if os.environ.get("TUTORIAL_EPOCHS"):
        Trainer.fit = lambda self, *a, epochs, **kwargs: fit(self, *a, epochs=min(
            epochs, int(os.environ["TUTORIAL_EPOCHS"])), **kwargs)
    mp_config["daemon"] = False  # (the workers end with each epoch's iterator)
    multiprocessing.set_start_method("fork", force=True)
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
finally:
    tv_cifar.check_integrity, Trainer.fit = check, fit
    mp_config["daemon"] = daemon
    multiprocessing.set_start_method(method, force=True)
