# The small byte-level GPT on 2 stacked 2 x 2 grids (2.5d, Tesseract): each grid runs SUMMA on
# half the batch, the grids share the weight blocks:
#   torchrun --nproc_per_node 8 train_gpt.py --config configs/gpt_2p5d.py
BATCH_SIZE = 32           # sequences per data-parallel replica and step (a multiple of 2 x 2)
NUM_EPOCHS = 4            # 4 x 131 steps: the sample reads like code (1 epoch: letters)
SEQ_LEN = 64              # tokens (bytes) per sequence
NUM_MICRO_BATCHES = 4     # used when parallel.pipeline > 1

# the model
DIM = 128
DEPTH = 4
HEADS = 4
MLP_RATIO = 4
DROPOUT = 0.0             # 0: every layout's loss equals one process's

parallel = dict(
    tensor=dict(size=8, mode='2.5d', depth=2),
)
