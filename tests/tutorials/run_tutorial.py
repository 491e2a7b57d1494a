"""Run a tutorial file as its reader would, under torchrun, on tiny CIFAR-10 files.

    torchrun --nproc_per_node 2 run_tutorial.py TUTORIAL.py [tutorial args]

Two things differ from a real machine, both here and not in the tutorial files: the tiny
CIFAR files cannot match the real archive's MD5 (torchvision's check is relaxed), and with
TUTORIAL_EPOCHS=N the Trainer runs at most N epochs (the pipeline tutorial hard-codes 60).
"""
import logging
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cifar_files import skip_cifar_md5  # noqa: E402

from nanocolossal.trainer import Trainer  # noqa: E402

script = sys.argv[1]
sys.argv = sys.argv[1:]
# the patches end with the tutorial: a pooled rank runs other tests' jobs after this one
fit = Trainer.fit
if os.environ.get("TUTORIAL_EPOCHS"):
    epochs_at_most = int(os.environ["TUTORIAL_EPOCHS"])
    Trainer.fit = lambda self, *args, epochs, **kwargs: fit(self, *args, epochs=min(
        epochs, epochs_at_most), **kwargs)
disabled = {name: logger.disabled for name, logger in logging.root.manager.loggerDict.items()
            if isinstance(logger, logging.Logger)}
try:
    with skip_cifar_md5():
        runpy.run_path(script, run_name="__main__")
finally:
    Trainer.fit = fit
    for name, logger in logging.root.manager.loggerDict.items():  # disable_existing_loggers()
        if isinstance(logger, logging.Logger):
            logger.disabled = disabled.get(name, False)
