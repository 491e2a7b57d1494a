# The Engine/Trainer tutorial, step 1 (config.py), with colossalai -> nanocolossal. The tutorial trains 200 epochs of
# batch 128; the test writes its own copy with 1 epoch and a smaller batch (see test_tutorials.py).
from nanocolossal.amp import AMP_TYPE

BATCH_SIZE = 128
NUM_EPOCHS = 200

fp16=dict(
    mode=AMP_TYPE.TORCH
)
