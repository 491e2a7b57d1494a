"""Run a tutorial file as its reader would, under torchrun, on tiny CIFAR-10 files.

    torchrun --nproc_per_node 2 run_tutorial.py TUTORIAL.py [tutorial args]

Two things differ from a real machine, both here and not in the tutorial files: the tiny
CIFAR files cannot match the real archive's MD5 (torchvision's check is relaxed), and with
TUTORIAL_EPOCHS=N the Trainer runs at most N epochs (the pipeline tutorial hard-codes 60).
"""
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cifar_files import skip_cifar_md5  # noqa: E402

skip_cifar_md5()
if os.environ.get("TUTORIAL_EPOCHS"):
    from nanocolossal.trainer import Trainer
    fit = Trainer.fit
    Trainer.fit = lambda self, *args, epochs, **kwargs: fit(self, *args, epochs=min(
        epochs, int(os.environ["TUTORIAL_EPOCHS"])), **kwargs)

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
