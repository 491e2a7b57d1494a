# The small byte-level GPT on a 2 x 2 x 2 cube (3d): activations, weights and outputs each split
# over two of the cube's axes:
#   torchrun --nproc_per_node 8 train_gpt.py --config configs/gpt_3d.py
BATCH_SIZE = 32           # sequences per data-parallel replica and step (a multiple of 2 x 2)
NUM_EPOCHS = 4            # 4 x 131 steps: the sample reads like code (1 epoch: letters)
SEQ_LEN = 64              # tokens (bytes) per sequence
NUM_MICRO_BATCHES = 4     # used when parallel.pipeline > 1

# the model
DIM = 128                 # a multiple of 2 x 2 (a Linear's input is split over two axes)
DEPTH = 4
HEADS = 4
MLP_RATIO = 4
DROPOUT = 0.0             # 0: every layout's loss equals one process's

parallel = dict(
    tensor=dict(size=8, mode='3d'),
)
