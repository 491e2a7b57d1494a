# The small byte-level GPT with every sequence split over 2 processes (ring attention):
#   torchrun --nproc_per_node 2 train_gpt.py --config configs/gpt_seq.py
BATCH_SIZE = 32           # sequences per data-parallel replica and step
NUM_EPOCHS = 4            # 4 x 131 steps: the sample reads like code (1 epoch: letters)
SEQ_LEN = 64              # tokens (bytes) per sequence: a multiple of 2 x sequence ranks
NUM_MICRO_BATCHES = 4     # used when parallel.pipeline > 1

# the model
DIM = 128
DEPTH = 4
HEADS = 4
MLP_RATIO = 4
DROPOUT = 0.0             # ring attention has no attention dropout; 0 also keeps one process's loss

parallel = dict(
    tensor=dict(size=2, mode='sequence'),
)
